"""Weight transports: versions, round trips, and no torn reads under concurrent writes."""

import multiprocessing as mp
import time

import pytest
import torch

from flywheel.weights import InProcessTransport, SharedMemoryTransport, TornRead

SHAPES = {"w": (256, 256), "b": (256,), "step": (1,)}


def _tensors(value: float) -> dict[str, torch.Tensor]:
    return {k: torch.full(s, float(value)) for k, s in SHAPES.items()}


def test_in_process_round_trip():
    t = InProcessTransport()
    assert t.version() == -1
    t.publish(_tensors(3), 3)
    dest = _tensors(0)
    assert t.read_into(dest) == 3 and torch.equal(dest["w"], torch.full((256, 256), 3.0))
    with pytest.raises(ValueError, match="increase"):
        t.publish(_tensors(2), 2)


def test_shared_memory_round_trip_and_errors():
    w = SharedMemoryTransport.create(_tensors(0))
    try:
        r = SharedMemoryTransport.attach(w.name)
        with pytest.raises(LookupError):
            r.read_into(_tensors(0))
        for v in (1, 2, 3):  # alternates buffers
            w.publish(_tensors(v), v)
            dest = _tensors(0)
            assert r.read_into(dest) == v and all(torch.all(t == v) for t in dest.values())
        with pytest.raises(ValueError, match="increase"):
            w.publish(_tensors(9), 3)
        with pytest.raises(KeyError, match="missing"):
            w.publish({"w": torch.zeros(256, 256)}, 4)
        assert r.wait_newer(2, timeout_s=0.1) == 3
        with pytest.raises(TimeoutError):
            r.wait_newer(3, timeout_s=0.05)
        r.close()
    finally:
        w.close()


def test_reader_retries_when_the_buffer_changes_under_it():
    w = SharedMemoryTransport.create(_tensors(0))
    try:
        w.publish(_tensors(1), 1)
        r = SharedMemoryTransport.attach(w.name)
        dest = _tensors(0)
        calls = {"n": 0}
        real_copy = dest["w"].copy_

        def copy_and_interfere(src):
            calls["n"] += 1
            if calls["n"] == 1:  # the writer laps the reader during its first copy
                w.publish(_tensors(2), 2)
                w.publish(_tensors(3), 3)
            return real_copy(src)

        dest["w"].copy_ = copy_and_interfere
        version = r.read_into(dest)
        assert calls["n"] >= 2  # the first read was discarded
        assert all(torch.all(t == version) for t in dest.values())
        # a buffer stuck mid-write (odd sequence) is never returned
        cur = int(w.header[1])
        w.header[2 + cur] += 1
        with pytest.raises(TornRead):
            r.read_into(_tensors(0), max_attempts=20)
        w.header[2 + cur] += 1
        r.close()
    finally:
        w.close()


def _writer(name: str, stop, out) -> None:
    w = SharedMemoryTransport.attach(name)
    v = 1
    while not stop.is_set():  # publish until the reader has had its fill
        w.publish(_tensors(v), v)
        v += 1
    out.put(v - 1)
    w.close()


def _reader(name: str, seconds: float, stop, out) -> None:
    r = SharedMemoryTransport.attach(name)
    r.wait_newer(-1, timeout_s=120)  # the writer may start later (spawn imports torch)
    reads = torn = 0
    seen = set()
    dest = _tensors(0)
    end = time.time() + seconds
    while time.time() < end:
        v = r.read_into(dest)
        reads += 1
        seen.add(v)
        # every element of every tensor must carry the same version (a checksum of the read)
        if not all(bool(torch.all(t == v)) for t in dest.values()):
            torn += 1
    stop.set()
    out.put((reads, torn, len(seen)))
    r.close()


def test_no_torn_reads_under_concurrent_writes():
    owner = SharedMemoryTransport.create(_tensors(0))
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    try:
        procs = [ctx.Process(target=_writer, args=(owner.name, stop, out)),
                 ctx.Process(target=_reader, args=(owner.name, 1.5, stop, out))]
        for p in procs:
            p.start()
        results = [out.get(timeout=180) for _ in procs]
        for p in procs:
            p.join(timeout=30)
        published = next(r for r in results if isinstance(r, int))
        reads, torn, distinct = next(r for r in results if isinstance(r, tuple))
        assert torn == 0
        assert reads > 50 and distinct > 10 and published > 50
    finally:
        owner.close()
