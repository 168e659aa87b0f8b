"""A weight sync that fails inside the vLLM worker must fail the sender, never leave it waiting.

Real verl 0.9.1 transport: ``BucketedWeightSender`` (actor side) and ``BucketedWeightReceiver``
(vLLM side) over a ZMQ IPC socket with a shared-memory bucket, several buckets per sync. The receiver
side goes through our patched ``update_weights_from_ipc`` dispatch; the stand-in for verl's method does
what verl's does (receive, one ``self._update_weights`` per bucket). Before the fix, a refused bucket
closed the receiving socket without a reply and the sender blocked in ``recv()`` forever (that is how
``main_ppo`` hung after a ``SyncModeError``).
"""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("zmq")

from verl_quads.patches import vllm_packed_weight_sync as patch  # noqa: E402
from verl_quads.sync.format import HEADER_NAME, SyncModeError, encode_header  # noqa: E402


class _Ext:
    """The attributes of verl's worker extension the dispatch reads, on an unquantized engine."""

    def __init__(self, handle: str, fail_on: str | None = None):
        self.model_runner = type("MR", (), {"vllm_config": type("VC", (), {"quant_config": None})()})()
        self.handle, self.fail_on, self.loaded = handle, fail_on, []

    def _update_weights(self, weights, peft_config=None, base_sync_done=False):
        for n, _ in weights:
            if n == self.fail_on:
                raise RuntimeError(f"load of {n} failed (stands in for a vLLM load_weights error)")
        self.loaded.extend(n for n, _ in weights)


def _verl_like_original(self, peft_config=None, base_sync_done=False, use_shm=False):
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

    receiver = BucketedWeightReceiver(zmq_handle=self.handle, device=torch.device("cpu"), use_shm=use_shm)
    receiver.receive_weights(lambda w, is_last: self._update_weights(w, peft_config=peft_config, base_sync_done=base_sync_done))


def _stream(packed: bool):
    if packed:
        yield HEADER_NAME, encode_header("quads", "w4a16", "quads", ["model.layers.0.mlp.experts"])
    for i in range(6):  # 6 x 600 kB tensors in 1 MiB buckets: one bucket each,: several buckets after the failing one
        yield f"model.layers.{i}.w", torch.full((150_000,), float(i))


def _run(ext: _Ext, packed: bool, timeout: float = 60.0):
    """Sender in this thread (real verl sender), receiver dispatch in another; returns the receiver's error."""
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    err: list[BaseException] = []

    def recv():
        try:
            patch.update_weights_from_ipc_dispatch(ext, _verl_like_original, use_shm=True)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            err.append(e)

    sent: list[BaseException | None] = []

    def send():
        sender = BucketedWeightSender(zmq_handle=ext.handle, bucket_size_mb=1, use_shm=True)
        try:
            asyncio.run(sender.async_send_weights(_stream(packed)))
            sent.append(None)
        except BaseException as e:  # noqa: BLE001
            sent.append(e)

    # Both ends in daemon threads: a sender blocked in recv() (the old hang) fails the test, not the run.
    s = threading.Thread(target=send, daemon=True)
    s.start()
    r = threading.Thread(target=recv, daemon=True)
    r.start()
    s.join(timeout)
    r.join(timeout)
    assert not s.is_alive(), "verl's sender is still waiting for a reply: the failed sync would hang main_ppo"
    assert not r.is_alive(), "receiver did not finish"
    assert sent == [None], sent
    return err[0] if err else None


def test_refused_packed_stream_drains_then_raises():
    ext = _Ext(f"ipc:///tmp/vq-test-{uuid.uuid4().hex}.sock")
    err = _run(ext, packed=True)
    assert isinstance(err, SyncModeError), err
    assert "trainer actor.quant='quads'" in str(err) and "mode 'none'" in str(err)
    assert ext.loaded == []  # the header is in the first bucket: nothing was loaded
    assert "_update_weights" not in vars(ext)


def test_stock_load_error_drains_then_raises():
    ext = _Ext(f"ipc:///tmp/vq-test-{uuid.uuid4().hex}.sock", fail_on="model.layers.2.w")
    err = _run(ext, packed=False)
    assert isinstance(err, RuntimeError) and "model.layers.2.w" in str(err), err
    assert ext.loaded == ["model.layers.0.w", "model.layers.1.w"]  # nothing after the failing bucket


def test_clean_stream_loads_everything():
    ext = _Ext(f"ipc:///tmp/vq-test-{uuid.uuid4().hex}.sock")
    assert _run(ext, packed=False) is None
    assert ext.loaded == [f"model.layers.{i}.w" for i in range(6)]
