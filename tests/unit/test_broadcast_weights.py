"""weights/broadcast.py over gloo, its members as threads of this process (each its own
process group on one TCPStore): every receiver gets each version whole, of every dtype; a
receiver's engine picks it up through LocalEngine.receive; a group that loses its publisher
ends its receivers' threads with the error kept, and `wait_newer` raises it."""

from __future__ import annotations

import threading

import pytest
import torch

from flywheel.weights.broadcast import BroadcastTransport


def weights(seed: float) -> dict[str, torch.Tensor]:
    return {"a": torch.full((3, 4), seed), "b": torch.arange(5, dtype=torch.float32) + seed,
            "c": torch.full((2,), seed, dtype=torch.bfloat16)}


def group(like, receivers: int = 2):
    """(publisher, [receivers]) formed together."""
    store = BroadcastTransport.host()
    ends: dict[int, BroadcastTransport] = {}

    def join(rank):
        ends[rank] = BroadcastTransport.receiver(like, "127.0.0.1", store.port, rank, receivers + 1)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(1, receivers + 1)]
    for t in threads:
        t.start()
    publisher = BroadcastTransport.publisher(like, store, receivers + 1)
    for t in threads:
        t.join(30)
    return publisher, [ends[r] for r in range(1, receivers + 1)]


def test_every_receiver_gets_each_version_whole():
    publisher, receivers = group(weights(0.0))
    try:
        assert [r.version() for r in receivers] == [-1, -1]
        for version in range(3):
            publisher.publish(weights(float(version)), version)
            for r in receivers:
                assert r.wait_newer(version - 1, timeout_s=10) == version
                got = {k: torch.empty_like(v) for k, v in weights(0.0).items()}
                assert r.read_into(got) == version
                for k, v in weights(float(version)).items():
                    assert torch.equal(got[k], v), (k, got[k], v)
        with pytest.raises(ValueError, match=r"'a' has shape \(4, 3\)"):
            publisher.publish({**weights(9.0), "a": torch.zeros(4, 3)}, 9)
    finally:
        for end in (*receivers, publisher):  # receivers first: their threads end before the store
            end.close()
    # no receiving thread outlives close(): one left polling the store after its publisher
    # closed printed a c10d backtrace in the middle of later tests
    assert [t.name for t in threading.enumerate() if t.name.startswith("weights-rank")] == []


def test_a_local_engine_takes_the_newest_version_from_a_receiver(tmp_path):
    from flywheel.inference import LocalEngine
    from flywheel.models import TinySpec, build_tiny_model, load

    model, tok = load(build_tiny_model(tmp_path / "m", TinySpec(hidden=32, layers=1, heads=2, ffn=64)))
    engine = LocalEngine(model, tok, version=-1)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    publisher, (receiver,) = group(params, receivers=1)
    try:
        newer = {k: v + 0.25 for k, v in params.items()}
        publisher.publish(newer, 4)
        receiver.wait_newer(-1, timeout_s=10)
        assert engine.receive(receiver) and engine.version == 4
        assert all(torch.equal(p.detach(), newer[k]) for k, p in model.named_parameters())
        assert not engine.receive(receiver)  # nothing newer
    finally:
        receiver.close()
        publisher.close()


def test_a_broken_group_ends_the_receivers_with_the_error():
    publisher, receivers = group(weights(0.0))
    publisher.publish(weights(1.0), 1)
    for r in receivers:
        r.wait_newer(0, timeout_s=10)
    publisher.close()  # abort: the group is gone for the receivers
    del publisher
    for r in receivers:
        with pytest.raises(RuntimeError, match="the weight group broke"):
            r.wait_newer(1, timeout_s=20)
        r.close()


def test_a_pause_longer_than_the_groups_timeout_loses_nothing(monkeypatch):
    """Receivers wait for the next version on the store, not inside a collective, so a pause
    between two publishes longer than the group's timeout (2 s here) breaks nothing."""
    import time
    from datetime import timedelta

    from flywheel.weights import broadcast

    monkeypatch.setattr(broadcast, "TIMEOUT", timedelta(seconds=2))
    publisher, receivers = group(weights(0.0))
    try:
        publisher.publish(weights(1.0), 1)
        time.sleep(3.0)
        publisher.publish(weights(2.0), 2)
        for r in receivers:
            assert r.wait_newer(1, timeout_s=10) == 2 and r.error is None
    finally:
        for end in (*receivers, publisher):  # receivers first: their threads end before the store
            end.close()
