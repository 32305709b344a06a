"""Zero-copy pickup from a SharedMemoryTransport: a reader slot and its lease on one buffer.

    reader = transport.reader()          # claims a slot (SharedMemoryTransport.create(readers=N))
    version, tensors = reader.acquire()  # tensors *are* the shared buffer, leased to this reader
    ...                                  # use them; no writer touches that buffer meanwhile
    reader.release()                     # or acquire() again: the lease moves to the newest buffer
    version = reader.bind(model)         # acquire + point each parameter's .data at the buffer

Pickup costs a lock and a few header words, not a copy. The tensors are shared memory: never
write to them, and treat the ones from an earlier acquire() as invalid once acquire() or
release() returns (a writer may then reuse that buffer). The protocol is in shm.py.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Mapping, Protocol, Sequence

import torch


class LeasedBuffers(Protocol):
    """What a reader needs of its transport (shm.py SharedMemoryTransport satisfies it)."""

    shapes: Mapping[str, torch.Size]  # tensor name -> shape, the same in every buffer
    views: Sequence[Mapping[str, torch.Tensor]]  # per buffer: tensor name -> a view of it
    header: Any  # None once the transport is closed

    def lease(self, slot: int) -> tuple[int, int]:
        """Lease the newest buffer to `slot`, dropping its previous lease: (version, buffer index)."""

    def end_lease(self, slot: int, free_slot: bool = False) -> None:
        """Drop `slot`'s lease (and, with free_slot, give the slot up)."""


class SharedMemoryReader:
    def __init__(self, transport: LeasedBuffers, slot: int):
        self.transport, self.slot = transport, slot
        self.version: int | None = None  # the version leased now (None: no lease)
        self.closed, self._pid = False, os.getpid()
        self._bound: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> [(name, tensor)]

    def acquire(self) -> tuple[int, dict[str, torch.Tensor]]:
        """Lease the newest buffer (releasing the previous one); return its version and views."""
        if self.closed:
            raise ValueError(f"reader slot {self.slot} is closed")
        if os.getpid() != self._pid:
            raise RuntimeError(f"reader slot {self.slot} belongs to pid {self._pid}; claim a slot in this process")
        self.version, b = self.transport.lease(self.slot)
        return self.version, dict(self.transport.views[b])

    def bind(self, module: torch.nn.Module, refresh: bool = False) -> int:
        """Acquire, then point every parameter of `module` (and every buffer the segment holds)
        at the leased views; return the version. Call it between forward passes: a forward
        running in another thread meanwhile could see two versions. The module's tensors are
        looked up and checked once per module (`refresh` after replacing its parameters)."""
        targets = self._bound.get(module)
        if targets is None or refresh:
            targets = self._bound[module] = self._targets(module)
        version, views = self.acquire()
        for key, t in targets:
            t.data = views[key]
        return version

    def _targets(self, module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
        shapes, views = self.transport.shapes, self.transport.views[0]
        params = dict(module.named_parameters())
        missing = set(params) - set(shapes)
        if missing:
            raise KeyError(f"bind: the segment holds no tensor for parameters {sorted(missing)[:5]}")
        targets = {**params, **{k: t for k, t in module.named_buffers() if k in shapes}}
        for key, t in targets.items():
            if t.device.type != "cpu":
                raise ValueError(f"bind: {key!r} is on {t.device}; shared memory is host memory (use read_into)")
            if t.shape != shapes[key] or t.dtype != views[key].dtype:
                raise ValueError(f"bind: {key!r} is {tuple(t.shape)} {t.dtype}, the segment holds "
                                 f"{tuple(shapes[key])} {views[key].dtype}")
        return list(targets.items())

    def release(self) -> None:
        """Give the leased buffer back to the writers."""
        if not self.closed and self.version is not None and os.getpid() == self._pid:
            self.transport.end_lease(self.slot)
        self.version = None

    def close(self) -> None:
        """Release the lease and free the slot for another reader."""
        if not self.closed and self.transport.header is not None and os.getpid() == self._pid:
            self.transport.end_lease(self.slot, free_slot=True)
        self.closed, self.version = True, None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass

    def __enter__(self) -> "SharedMemoryReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
