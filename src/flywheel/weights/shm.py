"""Shared-memory weight transport between local processes: versioned buffers, reader leases.

A learner publishes; samplers in other processes (spawned ones included: they attach by name)
pick the newest weights up in one of two ways:
- `read_into(dest)` copies them into the reader's own tensors (lock-free, retried until it
  has read one version whole: never a mix of versions);
- `reader(slot).acquire()` returns tensors that *are* the shared buffer (no copy: pickup costs
  microseconds at any model size) and leases that buffer, so no writer touches it until the
  reader releases it or acquires a newer one; `bind(module)` points a module's parameters at them.
Memory: B buffers of the whole model, B = readers + 2 by default, so one writer never waits
(W concurrent writers need B >= readers + 1 + W); short of buffers, `publish` raises
`NoFreeBuffer` after `timeout_s`. All of it is paged in when the segment is created and in
each process that attaches it, so no publish or pickup faults page by page. Versions only go
up, and a reader slot whose process died is reclaimed. The segment layout and the locking
protocol are described above `MAGIC` below.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import secrets
import threading
import time
import weakref
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import _posixshmem
import numpy as np
import torch

from flywheel.process import pid_alive
from flywheel.weights.base import WeightTransport
from flywheel.weights.shm_reader import SharedMemoryReader

# Segment layout: a header of int64 words, the tensor manifest (JSON), then B buffers each
# holding every tensor (64-byte aligned; the members of an `adjacent` group back to back):
#     [0] magic  [1] current buffer (-1 before the first publish)  [2] its version
#     [4] B  [5] N (reader slots)  [6] manifest bytes  ([3], [7] unused)
#     [8 + 2b] sequence counter of buffer b (odd while it is being written)
#     [9 + 2b] version of buffer b (while odd: the version being written; -1: none)
#     [8 + 2B + 2r] buffer leased by reader slot r (-1: none)  [9 + 2B + 2r] pid holding slot r (0: free)
#
# Protocol. Header updates that choose or hand out a buffer happen under an exclusive flock on
# the segment's file (plus a thread lock within a process); that lock is the memory fence:
# - publish: under the lock, refuse a version not above the current one and those being
#   written; pick a buffer that is not current, not being written and not leased (the one with
#   the oldest version), make its sequence odd, then store the version there (the
#   reservation); copy the tensors without the lock; under the lock again make the sequence
#   even and, if it is still the newest, make the buffer current (current, then its version).
#   A failed copy gives the buffer back with version -1. The writer never writes the current
#   buffer or a leased one, so with B >= N + 2 one writer never waits (W concurrent writers:
#   B >= N + 1 + W). Short of buffers, it waits for a lease to go and raises `NoFreeBuffer`
#   after `timeout_s`. A version older than the current one when its copy ends (a concurrent
#   writer finished a newer one first) is completed but not made current.
# - acquire: under the lock, lease the current buffer (the slot's single lease word moves to
#   it, so the previously acquired tensors lose their protection) and read its version. The
#   current buffer is always complete, and a writer choosing later sees the lease.
# - release: under the lock, clear the lease. Closing a reader frees its slot; a slot whose
#   pid has died is reclaimed (lease included) when a reader is claimed or a writer is short
#   of buffers. PIDs are compared within one pid namespace.
# - read_into: read current and its sequence, copy, and retry if the sequence changed or was
#   odd (or the version is -1): never a mix of versions. Aligned 8-byte header words are
#   written and read whole, and x86-64 keeps stores and loads in program order, which the
#   lock-free paths rely on.
MAGIC = 0x32577377686C7946  # "FlywhsW2"
ALIGN = 64
CURRENT, CURRENT_VERSION, N_BUFFERS, N_SLOTS, MANIFEST = 1, 2, 4, 5, 6
FIXED_WORDS = 8


class TornRead(RuntimeError):
    """The writer kept overwriting the buffer being read; the reader gave up."""


class NoFreeBuffer(RuntimeError):
    """Every buffer is current, being written or leased by a reader: the writer gave up."""


def recorded_segment_name(record: Path, log: Callable[[str], None] = print) -> str:
    """A fresh segment name, written to the file `record` (in a run's output folder); a
    segment named there by a killed earlier run of the same folder is removed first."""
    record = Path(record)
    if record.exists():
        old = record.read_text().strip()
        try:
            leftover = shared_memory.SharedMemory(name=old)
            leftover.close()
            leftover.unlink()
            log(f"removed shared memory {old} left by an earlier run")
        except (FileNotFoundError, ValueError):
            pass
    name = f"flywheel-{os.getpid()}-{secrets.token_hex(4)}"
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(name + "\n")
    return name


def _unlink(name: str) -> None:
    try:
        shared_memory.SharedMemory(name=name).unlink()
    except FileNotFoundError:
        pass


def _untrack(shm: shared_memory.SharedMemory) -> None:
    """Keep the segment out of multiprocessing's resource tracker. Python < 3.13 registers
    every open (create or attach) and unlinks at the process's exit, and child processes
    share their parent's tracker, so attaching in a worker would later unlink the learner's
    segment. Lifetime is ours instead: the creator unlinks it on close (and at exit)."""
    resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001


MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23  # Linux >= 5.14
PAGE = 4096


def _populate(shm: shared_memory.SharedMemory, write: bool) -> None:
    """Fault every page of the segment into this process now, not on its first use: the
    creator allocates them (`write`), a reader maps them. Otherwise the first publish into
    each buffer and each reader's first pickup of it pay a page fault per 4 KB, several times
    a memcpy of the bytes (docs/benchmarks.md). Where the kernel lacks MADV_POPULATE_* one
    byte per page is touched instead. Raises MemoryError, naming the segment and sizes, when
    /dev/shm cannot hold it: better at the start of a run than a SIGBUS in a publish."""
    try:
        shm._mmap.madvise(MADV_POPULATE_WRITE if write else MADV_POPULATE_READ)  # noqa: SLF001
        return
    except OSError as e:
        if e.errno in (errno.EFAULT, errno.ENOMEM):
            free = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
            where = "" if free is None else f" ({free.f_bavail * free.f_frsize / 1e9:.2f} GB free in /dev/shm)"
            raise MemoryError(f"shared memory {shm.name!r}: cannot back its {shm.size / 1e9:.2f} GB{where}; "
                              "give /dev/shm more room (docker: --shm-size) or publish fewer buffers") from e
        if e.errno != errno.EINVAL:
            raise
    pages = np.frombuffer(shm.buf, np.uint8)[::PAGE]
    if write:
        pages[:] = 0  # a new segment is zeros already
    else:
        int(pages.max())
    del pages


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _header_words(buffers: int, slots: int) -> int:
    return FIXED_WORDS + 2 * buffers + 2 * slots


def _layout_runs(like: Mapping[str, torch.Tensor], adjacent: Sequence[Sequence[str]]) -> list[list[str]]:
    """The names of `like` in segment order, as runs laid out back to back: each group of
    `adjacent` where its first member comes, every other name on its own."""
    group_of: dict[str, list[str]] = {}
    for group in adjacent:
        group = list(group)
        for key in group:
            if key not in like:
                raise KeyError(f"adjacent: no tensor {key!r} among those to lay out")
            if key in group_of:
                raise ValueError(f"adjacent: {key!r} is in two groups")
            group_of[key] = group
        first = like[group[0]]
        for key in group[1:]:
            t = like[key]
            if t.dtype != first.dtype or t.shape[1:] != first.shape[1:]:
                raise ValueError(f"adjacent: {key!r} is {tuple(t.shape)} {t.dtype}, {group[0]!r} is "
                                 f"{tuple(first.shape)} {first.dtype}: a group concatenates along dim 0")
    runs, placed = [], set()
    for key in like:
        if key not in placed:
            run = group_of.get(key, [key])
            runs.append(run)
            placed.update(run)
    return runs


class SharedMemoryTransport(WeightTransport):
    def __init__(self, shm: shared_memory.SharedMemory, owner: bool):
        self.shm, self.owner = shm, owner
        if owner:
            self._finalizer = weakref.finalize(self, _unlink, shm.name)
        fixed = np.ndarray((FIXED_WORDS,), dtype=np.int64, buffer=shm.buf[:8 * FIXED_WORDS])
        if fixed[0] != MAGIC:
            raise ValueError(f"shared memory {shm.name!r} is not a flywheel weight segment")
        self.n_buffers, self.n_slots, m_len = int(fixed[N_BUFFERS]), int(fixed[N_SLOTS]), int(fixed[MANIFEST])
        del fixed
        h_bytes = 8 * _header_words(self.n_buffers, self.n_slots)
        self.header = np.ndarray((h_bytes // 8,), dtype=np.int64, buffer=shm.buf[:h_bytes])
        self.manifest = json.loads(bytes(shm.buf[h_bytes:h_bytes + m_len]).decode())
        base = _align(h_bytes + m_len)
        size = self.manifest["buffer_bytes"]
        self.shapes = {name: torch.Size(shape) for name, shape, _, _ in self.manifest["tensors"]}
        self.views: list[dict[str, torch.Tensor]] = []
        for b in range(self.n_buffers):
            # through numpy, whose array holds a buffer export of the mapping for as long as any
            # view lives: close() then cannot unmap memory a tensor still points at
            # (torch.frombuffer keeps a reference but no export)
            raw = torch.from_numpy(np.frombuffer(shm.buf, np.uint8, size, base + b * size))  # (bytes,)
            views = {}
            for name, shape, dtype, offset in self.manifest["tensors"]:
                dt = getattr(torch, dtype)
                nbytes = math.prod(shape) * dt.itemsize
                views[name] = raw[offset:offset + nbytes].view(dt).view(shape)
            self.views.append(views)
        self._thread_lock, self._pid, self._lock_fd = threading.Lock(), os.getpid(), shm._fd  # noqa: SLF001
        self._readers: weakref.WeakSet = weakref.WeakSet()

    # ---------------------------------------------------------------- construction

    @classmethod
    def create(cls, like: Mapping[str, torch.Tensor], name: str | None = None, readers: int = 0,
               buffers: int | None = None, adjacent: Sequence[Sequence[str]] = ()) -> "SharedMemoryTransport":
        """A new segment sized for tensors shaped like `like` (the creator unlinks it on close),
        with `readers` zero-copy reader slots and `buffers` buffers (default readers + 2, the
        fewest with which a writer never waits; at least 2). `adjacent`: groups of names laid
        out back to back in the order given (same dtype and trailing dims), so a reader can view
        each group as one tensor concatenated along dim 0 (a fused q/k/v projection) without a
        copy; every other tensor starts 64-byte aligned."""
        buffers = readers + 2 if buffers is None else buffers
        if readers < 0 or buffers < 2:
            raise ValueError(f"need readers >= 0 and buffers >= 2, got readers={readers}, buffers={buffers}")
        tensors, offset = [], 0
        for run in _layout_runs(like, adjacent):
            for key in run:
                t = like[key]
                tensors.append([key, list(t.shape), str(t.dtype).removeprefix("torch."), offset])
                offset += t.numel() * t.element_size()
            offset = _align(offset)
        manifest = json.dumps({"tensors": tensors, "buffer_bytes": offset}).encode()
        h_bytes = 8 * _header_words(buffers, readers)
        total = _align(h_bytes + len(manifest)) + buffers * offset
        shm = shared_memory.SharedMemory(name=name, create=True, size=total)
        _untrack(shm)
        try:
            _populate(shm, write=True)
        except BaseException:
            shm.close()
            shm.unlink()
            raise
        header = np.ndarray((h_bytes // 8,), dtype=np.int64, buffer=shm.buf[:h_bytes])
        header[:] = 0
        header[CURRENT] = header[CURRENT_VERSION] = -1
        header[N_BUFFERS], header[N_SLOTS], header[MANIFEST] = buffers, readers, len(manifest)
        header[FIXED_WORDS + 1:FIXED_WORDS + 2 * buffers:2] = -1  # buffer versions
        header[FIXED_WORDS + 2 * buffers::2] = -1  # leases
        shm.buf[h_bytes:h_bytes + len(manifest)] = manifest
        header[0] = MAGIC
        del header
        return cls(shm, owner=True)

    @classmethod
    def attach(cls, name: str) -> "SharedMemoryTransport":
        shm = shared_memory.SharedMemory(name=name)
        _untrack(shm)
        try:
            _populate(shm, write=False)
        except BaseException:
            shm.close()
            raise
        return cls(shm, owner=False)

    @property
    def name(self) -> str:
        return self.shm.name

    # ---------------------------------------------------------------- header words and lock

    @staticmethod
    def _seq(b: int) -> int:
        return FIXED_WORDS + 2 * b

    def _lease(self, r: int) -> int:
        return FIXED_WORDS + 2 * self.n_buffers + 2 * r

    @contextlib.contextmanager
    def _locked(self) -> Iterator[np.ndarray]:
        """Exclusive over every process and thread using this segment (flock is per open file,
        so threads sharing this object also take the thread lock)."""
        if self.header is None:
            raise ValueError("the transport is closed")
        if os.getpid() != self._pid:  # forked: the inherited fd shares the parent's flock
            self._thread_lock, self._pid = threading.Lock(), os.getpid()
            self._lock_fd = _posixshmem.shm_open(self.shm._name, os.O_RDWR, mode=0o600)  # noqa: SLF001
        with self._thread_lock:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield self.header
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _reap(self, h: np.ndarray) -> None:
        """Free the slots (and leases) of readers whose process has died. Lock held."""
        for r in range(self.n_slots):
            pid = int(h[self._lease(r) + 1])
            if pid and pid != os.getpid() and not pid_alive(pid):
                h[self._lease(r)], h[self._lease(r) + 1] = -1, 0

    def leases(self) -> dict[int, int]:
        """{slot: buffer} for every slot holding a lease (a diagnostic)."""
        h = self.header
        return {r: int(h[self._lease(r)]) for r in range(self.n_slots) if h[self._lease(r)] >= 0}

    # ---------------------------------------------------------------- writer

    def _check(self, tensors: Mapping[str, torch.Tensor], what: str = "publish") -> None:
        """Raise KeyError for names the segment holds but `tensors` lacks, ValueError for shapes
        that differ from the segment's."""
        missing = set(self.shapes) - set(tensors)
        if missing:
            raise KeyError(f"{what} is missing tensors: {sorted(missing)[:5]}")
        for key, shape in self.shapes.items():
            if tensors[key].shape != shape:
                raise ValueError(f"{what}: {key!r} has shape {tuple(tensors[key].shape)}, "
                                 f"the segment holds {tuple(shape)}")

    def publish(self, tensors: Mapping[str, torch.Tensor], version: int, timeout_s: float = 30.0) -> None:
        """Copy `tensors` into a free buffer and make it current as `version`. Waits up to
        `timeout_s` when no buffer is free (only with fewer than readers + 1 + writers)."""
        if version <= self.version():
            raise ValueError(f"versions must increase: got {version} after {self.version()}")
        self._check(tensors)
        b = self._reserve(version, timeout_s)
        try:
            with torch.no_grad():
                for key, view in self.views[b].items():
                    view.copy_(tensors[key])
        except BaseException:
            with self._locked() as h:  # give the buffer (and the version) back, unpublished
                h[self._seq(b) + 1] = -1
                h[self._seq(b)] += 1
            raise
        with self._locked() as h:
            h[self._seq(b)] += 1  # even: complete
            if version > h[CURRENT_VERSION]:  # a concurrent writer may have published newer
                h[CURRENT] = b
                h[CURRENT_VERSION] = version

    def _reserve(self, version: int, timeout_s: float) -> int:
        deadline, pause = time.monotonic() + timeout_s, 1e-4
        while True:
            with self._locked() as h:
                taken = max([int(h[CURRENT_VERSION])] + [int(h[self._seq(b) + 1]) for b in range(self.n_buffers)
                                                          if h[self._seq(b)] % 2])  # published or being written
                if version <= taken:
                    raise ValueError(f"versions must increase: got {version} after {taken}")
                b = self._free_buffer(h)
                if b is None:
                    self._reap(h)
                    b = self._free_buffer(h)
                if b is not None:
                    h[self._seq(b)] += 1  # odd: being written (first: a read_into of b retries)
                    h[self._seq(b) + 1] = version  # the version being written, reserved
                    return b
                if time.monotonic() > deadline:
                    raise NoFreeBuffer(
                        f"no buffer free for version {version} after {timeout_s} s: {self.n_buffers} buffers, "
                        f"current {int(h[CURRENT])}, leases (slot: buffer) {self.leases()}, being written "
                        f"{[b for b in range(self.n_buffers) if h[self._seq(b)] % 2]}; release leases or "
                        f"create the segment with buffers >= readers + 2")
            time.sleep(pause)
            pause = min(pause * 2, 5e-3)

    def _free_buffer(self, h: np.ndarray) -> int | None:
        busy = {int(h[CURRENT])} | {int(h[self._lease(r)]) for r in range(self.n_slots)}
        free = [b for b in range(self.n_buffers) if b not in busy and h[self._seq(b)] % 2 == 0]
        return min(free, key=lambda b: h[self._seq(b) + 1]) if free else None

    # ---------------------------------------------------------------- readers

    def version(self) -> int:
        return int(self.header[CURRENT_VERSION])

    def read_into(self, dest: Mapping[str, torch.Tensor], max_attempts: int = 1000) -> int:
        """Copy the newest weights into `dest` (a subset of the segment's names, same shapes)."""
        for key, t in dest.items():
            if key not in self.shapes:
                raise KeyError(f"read_into: the segment holds no tensor {key!r}")
            if t.shape != self.shapes[key]:
                raise ValueError(f"read_into: {key!r} has shape {tuple(t.shape)}, "
                                 f"the segment holds {tuple(self.shapes[key])}")
        h = self.header
        for _ in range(max_attempts):
            cur = int(h[CURRENT])
            if cur < 0:
                raise LookupError("nothing has been published yet")
            seq = int(h[self._seq(cur)])
            version = int(h[self._seq(cur) + 1])
            if seq % 2 or version < 0:  # being written, or overwritten then given back since `cur`
                time.sleep(0)
                continue
            with torch.no_grad():
                for key, t in dest.items():
                    t.copy_(self.views[cur][key])
            if int(h[self._seq(cur)]) == seq:
                return version
        raise TornRead(f"gave up after {max_attempts} attempts: the writer kept overwriting the buffer")

    def wait_newer(self, than: int, timeout_s: float | None = None) -> int:
        """Block (sleeping, not spinning) until a version newer than `than` is published."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pause = 1e-4
        while (v := self.version()) <= than:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no version newer than {than} within {timeout_s} s")
            time.sleep(pause)
            pause = min(pause * 2, 5e-3)
        return v

    def reader(self, slot: int | None = None) -> "SharedMemoryReader":
        """Claim reader slot `slot` (None: the first free one) for zero-copy pickup."""
        with self._locked() as h:
            self._reap(h)
            if self.n_slots == 0:
                raise RuntimeError("this segment has no reader slots: create(..., readers=N) makes N")
            if slot is None:
                free = [r for r in range(self.n_slots) if h[self._lease(r) + 1] == 0]
                if not free:
                    pids = [int(h[self._lease(r) + 1]) for r in range(self.n_slots)]
                    raise RuntimeError(f"too many readers: all {self.n_slots} reader slots are taken "
                                       f"(pids {pids}); create the segment with more readers")
                slot = free[0]
            elif not 0 <= slot < self.n_slots:
                raise IndexError(f"unknown reader slot {slot}: this segment has {self.n_slots} "
                                 f"(create(..., readers=N) sets how many)")
            elif h[self._lease(slot) + 1] != 0:
                raise RuntimeError(f"reader slot {slot} is taken by pid {int(h[self._lease(slot) + 1])}")
            h[self._lease(slot)], h[self._lease(slot) + 1] = -1, os.getpid()
        reader = SharedMemoryReader(self, slot)
        self._readers.add(reader)
        return reader

    def lease(self, slot: int) -> tuple[int, int]:
        """Lease the current buffer to `slot` (dropping its previous lease): (version, buffer);
        for the slot's SharedMemoryReader (shm_reader.py LeasedBuffers)."""
        with self._locked() as h:
            cur = int(h[CURRENT])
            if cur < 0:
                raise LookupError("nothing has been published yet")
            h[self._lease(slot)] = cur
            return int(h[self._seq(cur) + 1]), cur

    def end_lease(self, slot: int, free_slot: bool = False) -> None:
        with self._locked() as h:
            h[self._lease(slot)] = -1
            if free_slot:
                h[self._lease(slot) + 1] = 0

    def close(self) -> None:
        """Free this object's reader slots, unmap and (creator) unlink. Tensors still viewing the
        segment (acquired or bound) keep the mapping alive until they are freed."""
        if self.header is None:
            return
        for reader in list(self._readers):
            reader.close()
        self._unmap()
        if self.owner:
            self._finalizer()

    def _unmap(self, _close_fd=os.close) -> None:  # (bound now: `os` may be gone at exit)
        self.views, self.header = [], None
        lock_fd, self._lock_fd = self._lock_fd, -1
        if lock_fd >= 0 and lock_fd != self.shm._fd:  # noqa: SLF001  (opened after a fork)
            _close_fd(lock_fd)
        try:
            self.shm.close()
        except BufferError:  # views are alive (acquired, bound): the mapping goes when they do
            fd, self.shm._fd, self.shm._buf, self.shm._mmap = self.shm._fd, -1, None, None  # noqa: SLF001
            if fd >= 0:
                _close_fd(fd)

    def __del__(self) -> None:  # before SharedMemory.__del__, which would raise on live views
        try:
            self._unmap()
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass
