"""Weights by broadcast over a torch.distributed group: one publisher, N receivers, NCCL
between GPUs (GPU to GPU, no host copy) and gloo otherwise.

The group. Rank 0 publishes, ranks 1..N receive; it is a process group of its own
(ProcessGroupGloo / ProcessGroupNCCL built on a TCPStore the publisher hosts, `port` 0: the OS
picks one), so a process that already belongs to another group (an FSDP2 rank) can join it.
Every member must construct its end before any of them returns (the rendezvous): start the
receivers, then the publisher, or each in a thread of its own.

The wire, per version: the publisher sets the store key `seq{n}` (n = 1, 2, ...) to the
version, then broadcasts one flat buffer per dtype (the tensors of `like` in their order,
flattened back to back). A receiver's thread waits on the store for the next key (polling, so
a long pause between versions is no collective timing out) and only then joins the
broadcast, into a back buffer it swaps in whole under a lock: `read_into` copies one version
entirely, never a mix (the WeightTransport contract), and `LocalEngine.receive(transport)`
picks it up like any transport's. On GPUs the receiving thread broadcasts on a CUDA stream
of its own and waits for it before the swap, so the engine's stream never waits on a
broadcast.

Failure: a member that dies breaks the group: the publisher's next `publish` raises (gloo:
the peer's connection closed, or the timeout) and the surviving receivers' threads end with
the error kept in `error`; the group is then formed again with fresh members
(orchestrate/ray_rollouts.py). `close` ends a receiver's thread at its next poll.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from flywheel.weights.base import WeightTransport

TIMEOUT = timedelta(seconds=120)  # forming the group; one version's broadcast once all have joined
_POLL = timedelta(seconds=1)  # a receiver's wait on the store between two checks of close()
_KEYS = "flywheel-weights/"


def _layout(like: Mapping[str, torch.Tensor]) -> list[tuple[torch.dtype, list[tuple[str, int, int, torch.Size]]]]:
    """[(dtype, [(name, offset, numel, shape)])]: the flat buffers, one per dtype, in first-seen order."""
    groups: dict[torch.dtype, list] = {}
    sizes: dict[torch.dtype, int] = {}
    for name, t in like.items():
        entries = groups.setdefault(t.dtype, [])
        offset = sizes.get(t.dtype, 0)
        entries.append((name, offset, t.numel(), t.shape))
        sizes[t.dtype] = offset + t.numel()
    return list(groups.items())


def _group(backend: str, host: str, port: int, rank: int, world_size: int, store=None):
    """(store, process group) of this member."""
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=TIMEOUT)
    prefixed = dist.PrefixStore("flywheel-weights", store)
    if backend == "nccl":
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise RuntimeError("weight broadcast over NCCL needs a CUDA build of torch")
        return store, dist.ProcessGroupNCCL(prefixed, rank, world_size)
    return store, dist.ProcessGroupGloo(prefixed, rank, world_size, TIMEOUT)


class BroadcastTransport(WeightTransport):
    """One member's end of the group: `publisher(...)` (rank 0) or `receiver(...)`."""

    def __init__(self, like: Mapping[str, torch.Tensor], rank: int, world_size: int, backend: str, device: str):
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = torch.device(device)
        self._layout = _layout(like)
        self._front = self._buffers()
        self._version = -1
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.error: BaseException | None = None  # a receiver's: why its thread ended
        self.store, self.group, self._thread = None, None, None
        self._seq, self._closed = 0, False
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def _buffers(self) -> list[torch.Tensor]:
        return [torch.empty(sum(n for _, _, n, _ in entries), dtype=dtype, device=self.device)
                for dtype, entries in self._layout]

    @classmethod
    def host(cls, host: str = "127.0.0.1") -> dist.TCPStore:
        """The publisher's store, made first so its port can be handed to the receivers."""
        return dist.TCPStore(host, 0, None, is_master=True, wait_for_workers=False, timeout=TIMEOUT)

    @classmethod
    def publisher(cls, like: Mapping[str, torch.Tensor], store: dist.TCPStore, world_size: int,
                  backend: str = "gloo", device: str = "cpu") -> "BroadcastTransport":
        """Rank 0, on `store` (from `host`); returns once every receiver has joined."""
        self = cls(like, 0, world_size, backend, device)
        self.store, self.group = _group(backend, "", 0, 0, world_size, store=store)
        return self

    @classmethod
    def receiver(cls, like: Mapping[str, torch.Tensor], host: str, port: int, rank: int, world_size: int,
                 backend: str = "gloo", device: str = "cpu") -> "BroadcastTransport":
        """Rank `rank` >= 1; returns once the group is formed, then receives in a thread."""
        self = cls(like, rank, world_size, backend, device)
        self.store, self.group = _group(backend, host, port, rank, world_size)
        self._thread = threading.Thread(target=self._receive, daemon=True, name=f"weights-rank{rank}")
        self._thread.start()
        return self

    # ------------------------------------------------------------------ publisher

    @torch.no_grad()
    def publish(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        if self.rank != 0:
            raise RuntimeError("only rank 0 of a weight group publishes")
        for buffer, (_, entries) in zip(self._front, self._layout):
            for name, offset, n, shape in entries:
                t = tensors[name]
                if t.shape != shape:
                    raise ValueError(f"publish: {name!r} has shape {tuple(t.shape)}, the group's is {tuple(shape)}")
                buffer[offset:offset + n].copy_(t.detach().reshape(-1))
        self._seq += 1
        self.store.set(f"{_KEYS}seq{self._seq}", str(int(version)))
        self._broadcast(self._front)
        self._version = int(version)

    def _broadcast(self, buffers: Sequence[torch.Tensor]) -> None:
        if self._stream is None:
            for t in buffers:
                self.group.broadcast(t, 0).wait()
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the buffers are written
        with torch.cuda.stream(self._stream):
            for t in buffers:
                self.group.broadcast(t, 0).wait()
        self._stream.synchronize()

    # ------------------------------------------------------------------ receiver

    def _receive(self) -> None:
        back = self._buffers()
        try:
            while True:
                version = self._next_version()
                if version is None:
                    return  # closed
                self._broadcast(back)
                with self._changed:
                    self._front, back = back, self._front
                    self._version = version
                    self._changed.notify_all()
        except BaseException as e:  # noqa: BLE001 - the group broke (a member died)
            with self._changed:
                self.error = e
                self._changed.notify_all()

    def _next_version(self) -> int | None:
        """Wait on the store for the next version's key (None once closed)."""
        key = f"{_KEYS}seq{self._seq + 1}"
        while not self._closed:
            try:
                self.store.wait([key], _POLL)
            except Exception as e:  # noqa: BLE001 - a timeout: poll again; the store gone: the group broke
                if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                    continue
                raise
            self._seq += 1
            return int(self.store.get(key))
        return None

    def version(self) -> int:
        return self._version

    def wait_newer(self, than: int, timeout_s: float | None = None) -> int:
        """Block until a version newer than `than` arrived; raises what broke the group."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._version > than or self.error is not None, timeout_s):
                raise TimeoutError(f"no weights newer than v{than} within {timeout_s} s")
            if self._version <= than:
                raise RuntimeError(f"the weight group broke: {self.error}")
            return self._version

    @contextmanager
    def current(self) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """(version, {name: view of its received buffer}) of the newest version, held: the
        receiving thread swaps nothing in until the block ends (a version arriving meanwhile
        waits in the back buffer). The views must not be kept past the block."""
        with self._lock:
            yield self._version, {name: buffer[offset:offset + n].view(shape)
                                  for buffer, (_, entries) in zip(self._front, self._layout)
                                  for name, offset, n, shape in entries}

    @torch.no_grad()
    def read_into(self, dest: Mapping[str, torch.Tensor]) -> int:
        with self.current() as (version, tensors):
            for name, t in dest.items():
                if name in tensors:
                    t.copy_(tensors[name])
            return version

    def close(self) -> None:
        """Leave the group. A receiver's thread has ended when this returns (it would otherwise
        go on polling a store whose publisher may be gone, and c10d prints a backtrace for
        that): close receivers before their publisher."""
        self._closed = True
        group, self.group = self.group, None
        if group is not None and hasattr(group, "abort"):
            try:
                group.abort()
            except Exception:  # noqa: BLE001
                pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(_POLL.total_seconds() * 5)
        self.store = None
