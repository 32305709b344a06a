"""Weight transports: versions, round trips, and no torn reads under concurrent writes."""

import multiprocessing as mp
import os
import threading
import time

import pytest
import torch

from flywheel.weights import InProcessTransport, SharedMemoryTransport, TornRead
from flywheel.weights.shm import NoFreeBuffer

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
        w.header[w._seq(cur)] += 1
        with pytest.raises(TornRead):
            r.read_into(_tensors(0), max_attempts=20)
        w.header[w._seq(cur)] += 1
        r.close()
    finally:
        w.close()


def _writer(name: str, stop, out) -> None:
    torch.set_num_threads(1)  # several processes on a small shared machine
    w = SharedMemoryTransport.attach(name)
    v = 1
    while not stop.is_set():  # publish until the reader has had its fill
        w.publish(_tensors(v), v)
        v += 1
    out.put(v - 1)
    w.close()


def _reader(name: str, stop, out) -> None:
    torch.set_num_threads(1)
    r = SharedMemoryTransport.attach(name)
    r.wait_newer(-1, timeout_s=120)  # the writer may start later (spawn imports torch)
    reads = torn = 0
    seen = set()
    dest = _tensors(0)
    end = time.time() + 60  # enough reads of enough versions, however loaded the machine is
    while time.time() < end and (reads < 200 or len(seen) < 30):
        v = r.read_into(dest)
        reads += 1
        seen.add(v)
        # every element of every tensor must carry the same version (a checksum of the read)
        if not all(bool(torch.all(t == v)) for t in dest.values()):
            torn += 1
    stop.set()
    out.put((reads, torn, len(seen)))
    r.close()


@pytest.mark.slow  # a multi-process stress run (spawned readers and writers, ~10 s of CPU): make test-all
def test_no_torn_reads_under_concurrent_writes():
    owner = SharedMemoryTransport.create(_tensors(0))
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    try:
        procs = [ctx.Process(target=_writer, args=(owner.name, stop, out)),
                 ctx.Process(target=_reader, args=(owner.name, stop, out))]
        for p in procs:
            p.start()
        results = [out.get(timeout=180) for _ in procs]
        for p in procs:
            p.join(timeout=30)
        published = next(r for r in results if isinstance(r, int))
        reads, torn, distinct = next(r for r in results if isinstance(r, tuple))
        assert torn == 0
        assert reads >= 200 and distinct >= 30 and published >= 30
    finally:
        owner.close()


# ---------------------------------------------------------------- zero-copy readers and leases


def _in_segment(t: torch.Tensor, transport: SharedMemoryTransport) -> bool:
    return any(t.data_ptr() == views["w"].data_ptr() for views in transport.views)


def test_acquire_leases_the_buffer_until_release():
    w = SharedMemoryTransport.create(_tensors(0), readers=1)  # 3 buffers
    try:
        r = SharedMemoryTransport.attach(w.name).reader()
        assert r.slot == 0 and w.n_buffers == 3
        with pytest.raises(LookupError):
            r.acquire()
        w.publish(_tensors(1), 1)
        v, held = r.acquire()
        assert v == 1 and _in_segment(held["w"], r.transport)  # a view of the shared buffer, not a copy
        (leased,) = w.leases().values()
        for v in range(2, 8):  # the writer cycles through the two other buffers
            w.publish(_tensors(v), v)
            assert all(torch.all(t == 1) for t in held.values())
        assert w.version() == 7 and w.leases() == {0: leased}
        v, held = r.acquire()  # the lease moves to the newest buffer
        assert v == 7 and all(torch.all(t == 7) for t in held.values()) and w.leases()[0] != leased
        r.release()
        assert w.leases() == {} and r.version is None
        r.close()
        assert SharedMemoryTransport.attach(w.name).reader(0).slot == 0  # the slot is free again
        del held
    finally:
        w.close()


def test_bind_points_module_parameters_at_the_shared_buffer():
    module = torch.nn.Linear(4, 3)
    w = SharedMemoryTransport.create(dict(module.named_parameters()), readers=1)
    try:
        r = w.reader()
        w.publish({"weight": torch.ones(3, 4), "bias": torch.full((3,), 2.0)}, 1)
        assert r.bind(module) == 1
        x = torch.ones(1, 4)
        assert torch.equal(module(x), torch.full((1, 3), 6.0))
        assert any(module.weight.data_ptr() == views["weight"].data_ptr() for views in w.views)
        w.publish({"weight": torch.zeros(3, 4), "bias": torch.zeros(3)}, 2)
        assert torch.equal(module(x), torch.full((1, 3), 6.0))  # bound to the leased version 1
        assert r.bind(module) == 2 and torch.equal(module(x), torch.zeros(1, 3))
        with pytest.raises(ValueError, match="bind: 'weight' is \\(5, 4\\)"):
            r.bind(torch.nn.Linear(4, 5))
        with pytest.raises(KeyError, match="no tensor for parameters"):
            r.bind(torch.nn.Sequential(torch.nn.Linear(4, 3)))
        assert r.version == 2  # a refused bind keeps the lease it had
    finally:
        w.close()  # the module's parameters keep the mapping alive
    assert torch.equal(module(x), torch.zeros(1, 3))


def test_reader_and_shape_errors_are_clear():
    w = SharedMemoryTransport.create(_tensors(0), readers=2)
    try:
        with pytest.raises(IndexError, match="unknown reader slot 2: this segment has 2"):
            w.reader(2)
        first = w.reader()
        with pytest.raises(RuntimeError, match="slot 0 is taken"):
            w.reader(0)
        second = w.reader()
        with pytest.raises(RuntimeError, match="too many readers"):
            w.reader()
        first.close()
        third = w.reader()
        assert (second.slot, third.slot) == (1, 0)
        del second  # a reader dropped without close() frees its slot too
        assert w.reader().slot == 1
        with pytest.raises(ValueError, match="'w' has shape \\(256, 255\\), the segment holds \\(256, 256\\)"):
            w.publish({**_tensors(1), "w": torch.zeros(256, 255)}, 1)
        w.publish(_tensors(1), 1)  # the refused publish consumed nothing
        with pytest.raises(ValueError, match="read_into: 'b' has shape"):
            w.read_into({"b": torch.zeros(3)})
        with pytest.raises(KeyError, match="no tensor 'x'"):
            w.read_into({"x": torch.zeros(3)})
        with pytest.raises(RuntimeError, match="no reader slots"):
            SharedMemoryTransport.create(_tensors(0)).reader()
        with pytest.raises(ValueError, match="buffers >= 2"):
            SharedMemoryTransport.create(_tensors(0), buffers=1)
    finally:
        w.close()


def test_writer_waits_for_a_lease_then_errors_clearly():
    w = SharedMemoryTransport.create(_tensors(0), readers=2, buffers=2)  # fewer than readers + 2
    try:
        r0, r1 = w.reader(), w.reader()
        w.publish(_tensors(1), 1)
        _, held0 = r0.acquire()
        w.publish(_tensors(2), 2)
        _, held1 = r1.acquire()  # both buffers leased, one of them current
        with pytest.raises(NoFreeBuffer, match="no buffer free for version 3 .* leases \\(slot: buffer\\)"):
            w.publish(_tensors(3), 3, timeout_s=0.05)
        done = threading.Event()
        writer = threading.Thread(target=lambda: (w.publish(_tensors(3), 3, timeout_s=10), done.set()))
        writer.start()
        time.sleep(0.1)
        assert not done.is_set()  # waiting for a lease to go
        assert all(torch.all(t == 1) for t in held0.values())
        r0.release()
        writer.join(timeout=10)
        assert done.is_set() and w.version() == 3
        assert all(torch.all(t == 2) for t in held1.values())  # the other lease was respected
        del held0, held1
    finally:
        w.close()


def _die_holding_a_lease(name: str) -> None:
    r = SharedMemoryTransport.attach(name).reader(0)
    r.acquire()
    os._exit(0)  # no release, no close


def test_a_dead_readers_slot_and_lease_are_reclaimed():
    w = SharedMemoryTransport.create(_tensors(0), readers=1, buffers=2)
    try:
        w.publish(_tensors(1), 1)
        child = mp.get_context("spawn").Process(target=_die_holding_a_lease, args=(w.name,))
        child.start()
        child.join(timeout=120)
        assert child.exitcode == 0 and w.leases() == {0: int(w.header[1])}
        w.publish(_tensors(2), 2)  # into the other buffer
        w.publish(_tensors(3), 3, timeout_s=1)  # needs the dead reader's buffer
        assert w.version() == 3 and w.leases() == {}
        assert w.reader(0).slot == 0
    finally:
        w.close()


def _lease_writer(name: str, stop, out) -> None:
    torch.set_num_threads(1)  # four processes on a small shared machine
    w = SharedMemoryTransport.attach(name)
    published = refused = 0
    while not stop.is_set():
        v = w.version() + 1
        try:  # another writer may take this version first
            w.publish(_tensors(v), v)
            published += 1
        except ValueError:
            refused += 1
    out.put(("writer", published, refused))
    w.close()


def _lease_reader(name: str, slot: int, out) -> None:
    torch.set_num_threads(1)
    t = SharedMemoryTransport.attach(name)
    r = t.reader(slot)
    t.wait_newer(-1, timeout_s=120)  # the writers may start later (spawn imports torch)
    acquires = bad = modified = backwards = 0
    seen, last = set(), -1
    end = time.time() + 60  # enough acquires of enough versions, however loaded the machine is
    while time.time() < end and (acquires < 200 or len(seen) < 30):
        v, held = r.acquire()
        acquires += 1
        seen.add(v)
        backwards += v < last
        last = v
        # checksum: every element of every tensor carries the version it was published as
        bad += not all(bool(torch.all(x == v)) for x in held.values())
        time.sleep(0.002)  # hold the lease while the writers publish
        modified += not all(bool(torch.all(x == v)) for x in held.values())
        if acquires % 3 == 0:
            r.release()
    del held
    r.close()
    out.put(("reader", acquires, bad, modified, backwards, len(seen)))
    t.close()


@pytest.mark.slow  # a multi-process stress run (spawned readers and writers, ~10 s of CPU): make test-all
def test_leased_buffers_are_never_modified_under_concurrent_writers():
    owner = SharedMemoryTransport.create(_tensors(0), readers=2)  # 4 buffers, 2 writers: some waits
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    try:
        readers = [ctx.Process(target=_lease_reader, args=(owner.name, s, out)) for s in (0, 1)]
        writers = [ctx.Process(target=_lease_writer, args=(owner.name, stop, out)) for _ in range(2)]
        for p in readers + writers:
            p.start()
        results = [out.get(timeout=180) for _ in readers]
        stop.set()
        results += [out.get(timeout=60) for _ in writers]
        for p in readers + writers:
            p.join(timeout=30)
            assert p.exitcode == 0
        for kind, *r in results:
            if kind == "reader":
                acquires, bad, modified, backwards, distinct = r
                assert (bad, modified, backwards) == (0, 0, 0)
                assert acquires >= 200 and distinct >= 30
            else:
                assert r[0] > 0
        assert owner.leases() == {}  # every lease released
        assert all(owner.header[owner._lease(s) + 1] == 0 for s in (0, 1))  # and every slot freed
    finally:
        owner.close()


class _FailsToCopy:
    shape = torch.Size(SHAPES["b"])  # passes the shape check, then copy_ refuses it


def test_a_failed_publish_gives_its_buffer_and_version_back():
    w = SharedMemoryTransport.create(_tensors(0), readers=1)
    try:
        w.publish(_tensors(1), 1)
        with pytest.raises(TypeError):
            w.publish({**_tensors(2), "b": _FailsToCopy()}, 2)
        assert w.version() == 1 and all(w.header[w._seq(b)] % 2 == 0 for b in range(w.n_buffers))
        w.publish(_tensors(2), 2)  # the version was not consumed
        dest = _tensors(0)
        assert w.read_into(dest) == 2 and all(torch.all(t == 2) for t in dest.values())
    finally:
        w.close()


def _publish_from_fork(transport: SharedMemoryTransport, out) -> None:
    torch.set_num_threads(1)  # OpenMP is not fork-safe once the parent has used it
    transport.publish(_tensors(5), 5)  # through the object inherited from the parent
    out.put(transport._lock_fd != transport.shm._fd)


@pytest.mark.skipif("fork" not in mp.get_all_start_methods(), reason="no fork here")
def test_a_forked_child_takes_its_own_lock():
    w = SharedMemoryTransport.create(_tensors(0))
    try:
        w.publish(_tensors(1), 1)
        ctx = mp.get_context("fork")
        out = ctx.Queue()
        child = ctx.Process(target=_publish_from_fork, args=(w, out))
        child.start()
        assert out.get(timeout=60) is True  # flock on the inherited fd would not exclude the parent
        child.join(timeout=60)
        assert child.exitcode == 0 and w.version() == 5
    finally:
        w.close()


def test_adjacent_groups_are_laid_out_back_to_back():
    like = {"q": torch.zeros(3, 5), "bias": torch.zeros(3), "k": torch.zeros(2, 5), "v": torch.zeros(1, 5),
            "n": torch.zeros(7)}
    w = SharedMemoryTransport.create(like, readers=1, adjacent=[["q", "k", "v"]])
    try:
        views = w.views[0]
        # 3 x 5 floats = 60 bytes, not a multiple of 64: without the group, k would start 4 bytes later
        assert views["k"].data_ptr() == views["q"].data_ptr() + 60
        assert views["v"].data_ptr() == views["k"].data_ptr() + 40
        assert all(views[k].data_ptr() % 64 == 0 for k in ("q", "bias", "n"))  # the others stay aligned
        new = {k: torch.randn(t.shape) for k, t in like.items()}
        w.publish(new, 1)
        _, held = w.reader().acquire()
        fused = held["q"].as_strided((6, 5), (5, 1), held["q"].storage_offset())
        assert torch.equal(fused, torch.cat([new["q"], new["k"], new["v"]]))
        del held, fused
    finally:
        w.close()
    with pytest.raises(KeyError, match="no tensor 'x'"):
        SharedMemoryTransport.create(like, adjacent=[["q", "x"]])
    with pytest.raises(ValueError, match="two groups"):
        SharedMemoryTransport.create(like, adjacent=[["q", "k"], ["k", "v"]])
    with pytest.raises(ValueError, match="concatenates along dim 0"):
        SharedMemoryTransport.create(like, adjacent=[["q", "bias"]])


def _resident_bytes(name: str) -> list[int]:
    """Rss of each of this process's mappings of shared-memory segment `name` (/proc/self/smaps)."""
    sizes, inside = [], False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = fields[-1] == f"/dev/shm/{name}"
        elif inside and fields[0] == "Rss:":
            sizes.append(int(fields[1]) * 1024)
    return sizes


def test_segments_are_paged_in_at_create_and_attach():
    like = {"w": torch.zeros(2_000_000)}  # 8 MB a buffer: first touches would fault ~2,000 pages each
    w = SharedMemoryTransport.create(like, readers=1)
    try:
        size = w.shm.size
        assert _resident_bytes(w.name) == [pytest.approx(size, abs=4096)]  # before any publish
        r = SharedMemoryTransport.attach(w.name)
        assert sorted(_resident_bytes(w.name)) == [pytest.approx(size, abs=4096)] * 2  # before any pickup
        r.close()
    finally:
        w.close()


def test_paging_in_names_the_segment_when_dev_shm_is_full_and_falls_back_on_old_kernels():
    import errno
    from types import SimpleNamespace

    from flywheel.weights.shm import _populate

    def stand_in(err):
        def madvise(option):
            raise OSError(err, os.strerror(err))
        return SimpleNamespace(_mmap=SimpleNamespace(madvise=madvise), buf=bytearray(3 * 4096),
                               name="flywheel-x", size=3 * 4096)

    with pytest.raises(MemoryError, match=r"'flywheel-x': cannot back its 0.00 GB.*--shm-size"):
        _populate(stand_in(errno.EFAULT), write=True)
    for write in (True, False):  # kernels before 5.14: one byte a page touched instead
        _populate(stand_in(errno.EINVAL), write=write)
    with pytest.raises(PermissionError):
        _populate(stand_in(errno.EPERM), write=False)
