"""AdapterPool: the LoRA adapters one engine serves, by name, at most `max_resident` in memory.

`register(name, folder)` makes an adapter known (read and checked against the decoder, then let
go); it is read and laid out for the decoder (inference/lora.py) the first time a request names
it, and the least recently used one is dropped from memory when more than `max_resident` are
resident. A dropped adapter stays registered and comes back on its next request; rows decoding
with it meanwhile keep the tensors they hold. `get` is called by the thread that admits
requests, the one that runs the forwards, so the layout's tensor work runs there too
(inference/decoder.py THREADS); `register` and `unregister` may come from others (a lock guards
the tables).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import torch

from flywheel.inference.lora import AdapterError, Layout, Resident, check_fits, read_adapter


class AdapterPool:
    def __init__(self, layout: Layout, dtype: torch.dtype, device: torch.device, *, max_resident: int = 8):
        if max_resident < 1:
            raise ValueError(f"max_resident must be >= 1, got {max_resident}")
        self.layout, self.dtype, self.device = layout, dtype, device
        self.max_resident = max_resident
        self._folders: dict[str, Path] = {}
        self._resident: OrderedDict[str, Resident] = OrderedDict()
        self._lock = threading.Lock()
        self.loads = 0  # adapters read from disk so far (a resident hit reads nothing)

    def register(self, name: str, folder: str | Path, *, load: bool = True) -> None:
        """Serve the adapter in `folder` as `name` (replacing one of that name). load: read and
        check it now, so a folder the engine cannot serve is refused here (AdapterError); it is
        laid out by its first request."""
        folder = Path(folder)
        if load:
            check_fits(read_adapter(folder, name), self.layout)
            self.loads += 1
        with self._lock:
            self._folders[name] = folder
            self._resident.pop(name, None)

    def unregister(self, name: str) -> None:
        with self._lock:
            self._folders.pop(name, None)
            self._resident.pop(name, None)

    def get(self, name: str) -> Resident:
        """The resident adapter `name`, read first if it is not; AdapterError if unknown."""
        with self._lock:
            resident = self._resident.get(name)
            if resident is not None:
                self._resident.move_to_end(name)
                return resident
            folder = self._folders.get(name)
        if folder is None:
            raise AdapterError(f"no adapter {name!r} is registered with this engine")
        resident = self._read(name, folder)
        with self._lock:
            if name in self._folders:
                self._keep(name, resident)
        return resident

    @property
    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._folders)

    @property
    def resident(self) -> list[str]:
        """The names in memory, least recently used first."""
        with self._lock:
            return list(self._resident)

    @property
    def resident_bytes(self) -> int:
        with self._lock:
            return sum(r.nbytes for r in self._resident.values())

    def _read(self, name: str, folder: Path) -> Resident:
        resident = Resident(read_adapter(folder, name), self.layout, self.dtype, self.device)
        self.loads += 1
        return resident

    def _keep(self, name: str, resident: Resident) -> None:
        self._resident[name] = resident
        self._resident.move_to_end(name)
        while len(self._resident) > self.max_resident:
            self._resident.popitem(last=False)
