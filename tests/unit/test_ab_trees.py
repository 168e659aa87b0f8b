"""scripts/ab_trees.sh: the "before" run imports the prepared tree's verl_quads and the "after" run the checkout's
(the point of the script: ``PYTHONPATH=DIR python -m`` imports the checkout's, since -m puts the cwd first)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_before_runs_import_the_prepared_tree_after_runs_the_checkout(tmp_path):
    tree = tmp_path / "tree"
    (tree / "verl_quads").mkdir(parents=True)
    (tree / "verl_quads" / "__init__.py").write_text("MARK = 'old'\n")
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # python3 = this interpreter
    cmd = [sys.executable, "-c", "import verl_quads; print('MARK', getattr(verl_quads, 'MARK', 'new'))"]
    subprocess.run(["bash", str(ROOT / "scripts/ab_trees.sh"), "run", "2", str(tree), str(out), "--", *cmd],
                   cwd=ROOT, env=env, check=True, timeout=120)
    for r in (1, 2):
        before = (out / f"before{r}.txt").read_text()
        after = (out / f"after{r}.txt").read_text()
        assert f"verl_quads from {tree}/verl_quads/__init__.py" in before and "MARK old" in before, before
        assert f"verl_quads from {ROOT}/verl_quads/__init__.py" in after and "MARK new" in after, after


def test_prepare_refuses_a_folder_git_would_track(tmp_path):
    res = subprocess.run(["bash", str(ROOT / "scripts/ab_trees.sh"), "prepare", "HEAD", "not_ignored_dir"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "not git-ignored" in res.stderr
    assert not (ROOT / "not_ignored_dir").exists()


def test_prepare_writes_the_package_of_the_commit(tmp_path):
    import shutil
    import uuid

    rel = f".abtree/t-{uuid.uuid4().hex[:8]}"  # under the ignored .abtree/
    try:
        subprocess.run(["bash", str(ROOT / "scripts/ab_trees.sh"), "prepare", "HEAD", rel], cwd=ROOT, check=True,
                       capture_output=True, timeout=120)
        want = subprocess.run(["git", "show", "HEAD:verl_quads/nvfp4/__init__.py"], cwd=ROOT, capture_output=True,
                              check=True).stdout
        assert (ROOT / rel / "verl_quads/nvfp4/__init__.py").read_bytes() == want
        assert not (ROOT / rel / "tests").exists()  # the package only
    finally:
        shutil.rmtree(ROOT / rel, ignore_errors=True)
