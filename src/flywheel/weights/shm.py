"""Shared-memory weight transport between local processes: double-buffered and versioned.

Segment layout: a 64-byte header of int64 slots, the tensor manifest (JSON), then two
buffers each holding every tensor (64-byte aligned):
    header[0] magic, [1] current buffer (-1 before the first publish),
    [2 + b] sequence counter of buffer b (odd while it is being written), [4 + b] its version,
    [6] manifest length in bytes.
The writer fills the buffer that is *not* current (sequence odd, copy, version, sequence
even), then flips `current`. A reader copies the current buffer between two reads of its
sequence counter and retries if it changed or was odd: it never returns a mix of versions.
Header slots are aligned 8-byte words, written and read whole (x86-64 keeps stores and loads
in program order, which this relies on).
"""

from __future__ import annotations

import json
import math
import time
import weakref
from multiprocessing import resource_tracker, shared_memory
from typing import Mapping

import numpy as np
import torch

from flywheel.weights.base import WeightTransport

MAGIC = 0x466C7977686C5753  # "FlywhlWS"
HEADER_BYTES = 64
ALIGN = 64


def _unlink(name: str) -> None:
    try:
        shared_memory.SharedMemory(name=name).unlink()
    except FileNotFoundError:
        pass


class TornRead(RuntimeError):
    """The writer kept overwriting the buffer being read; the reader gave up."""


def _untrack(shm: shared_memory.SharedMemory) -> None:
    """Keep the segment out of multiprocessing's resource tracker. Python < 3.13 registers
    every open (create or attach) and unlinks at the process's exit, and child processes
    share their parent's tracker, so attaching in a worker would later unlink the learner's
    segment. Lifetime is ours instead: the creator unlinks it on close (and at exit)."""
    resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class SharedMemoryTransport(WeightTransport):
    def __init__(self, shm: shared_memory.SharedMemory, owner: bool):
        self.shm, self.owner = shm, owner
        if owner:
            self._finalizer = weakref.finalize(self, _unlink, shm.name)
        self.header = np.ndarray((8,), dtype=np.int64, buffer=shm.buf[:HEADER_BYTES])
        if self.header[0] != MAGIC:
            raise ValueError(f"shared memory {shm.name!r} is not a flywheel weight segment")
        m_len = int(self.header[6])
        self.manifest = json.loads(bytes(shm.buf[HEADER_BYTES:HEADER_BYTES + m_len]).decode())
        base = _align(HEADER_BYTES + m_len)
        size = self.manifest["buffer_bytes"]
        self.views: list[dict[str, torch.Tensor]] = []
        for b in range(2):
            views = {}
            for name, shape, dtype, offset in self.manifest["tensors"]:
                dt = getattr(torch, dtype)
                count = math.prod(shape)
                flat = torch.frombuffer(shm.buf, dtype=dt, count=count, offset=base + b * size + offset)
                views[name] = flat.view(shape)
            self.views.append(views)

    # ---------------------------------------------------------------- construction

    @classmethod
    def create(cls, like: Mapping[str, torch.Tensor], name: str | None = None) -> "SharedMemoryTransport":
        """A new segment sized for tensors shaped like `like` (the creator unlinks it on close)."""
        tensors, offset = [], 0
        for key, t in like.items():
            tensors.append([key, list(t.shape), str(t.dtype).removeprefix("torch."), offset])
            offset = _align(offset + t.numel() * t.element_size())
        manifest = json.dumps({"tensors": tensors, "buffer_bytes": offset}).encode()
        total = _align(HEADER_BYTES + len(manifest)) + 2 * offset
        shm = shared_memory.SharedMemory(name=name, create=True, size=total)
        _untrack(shm)
        header = np.ndarray((8,), dtype=np.int64, buffer=shm.buf[:HEADER_BYTES])
        header[:] = 0
        header[1], header[4], header[5], header[6] = -1, -1, -1, len(manifest)
        shm.buf[HEADER_BYTES:HEADER_BYTES + len(manifest)] = manifest
        header[0] = MAGIC
        return cls(shm, owner=True)

    @classmethod
    def attach(cls, name: str) -> "SharedMemoryTransport":
        shm = shared_memory.SharedMemory(name=name)
        _untrack(shm)
        return cls(shm, owner=False)

    @property
    def name(self) -> str:
        return self.shm.name

    # ---------------------------------------------------------------- writer

    def publish(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        h = self.header
        if version <= self.version():
            raise ValueError(f"versions must increase: got {version} after {self.version()}")
        missing = set(self.views[0]) - set(tensors)
        if missing:
            raise KeyError(f"publish is missing tensors: {sorted(missing)[:5]}")
        cur = int(h[1])
        b = 1 if cur == 0 else 0
        h[2 + b] += 1  # odd: being written
        with torch.no_grad():
            for key, view in self.views[b].items():
                view.copy_(tensors[key])
        h[4 + b] = version
        h[2 + b] += 1  # even: complete
        h[1] = b

    # ---------------------------------------------------------------- readers

    def version(self) -> int:
        cur = int(self.header[1])
        return -1 if cur < 0 else int(self.header[4 + cur])

    def read_into(self, dest: Mapping[str, torch.Tensor], max_attempts: int = 1000) -> int:
        h = self.header
        for _ in range(max_attempts):
            cur = int(h[1])
            if cur < 0:
                raise LookupError("nothing has been published yet")
            seq = int(h[2 + cur])
            if seq % 2:
                time.sleep(0)
                continue
            version = int(h[4 + cur])
            with torch.no_grad():
                for key, t in dest.items():
                    t.copy_(self.views[cur][key])
            if int(h[2 + cur]) == seq:
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

    def close(self) -> None:
        self.views = []
        self.header = None
        self.shm.close()
        if self.owner:
            self._finalizer()
