"""Hardware catalog: price and capability of each kind of device, from a YAML file.

The shipped catalog is `hardware.yaml` next to this module. A user-edited copy replaces it
when passed as `path` or named by the environment variable FLYWHEEL_HARDWARE. Every entry is
validated (pydantic, unknown keys refused); a bad entry raises `CatalogError` naming the
file, the entry (index and name) and the field.

One entry describes one *device*, the unit a ledger record counts: a GPU, or for a CPU
machine the whole instance. Prices are on-demand list prices per device-hour; peak FLOP/s
are dense at the precision the entry states. See docs/economics.md for the sources.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

ENV_VAR = "FLYWHEEL_HARDWARE"
SHIPPED = Path(__file__).with_name("hardware.yaml")


class CatalogError(ValueError):
    """The hardware catalog is unreadable or invalid; the message names file, entry and field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class System(_Strict):
    """A rack-scale system that the device is sold in (e.g. 72 GPUs per NVL72 rack)."""

    name: str = Field(..., min_length=1)
    devices: int = Field(..., ge=1, description="devices per system")


class Hardware(_Strict):
    name: str = Field(..., min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                      description="key used by ledger records and --project")
    aliases: list[str] = Field(default_factory=list, description="other names accepted on lookup")
    kind: Literal["cpu", "gpu"]
    description: str = ""
    unit: str = Field(..., min_length=1, description="what one device is, e.g. '1 GPU'")
    system: System | None = None
    usd_per_hour: float = Field(..., gt=0, description="US dollars per device-hour")
    price_note: str = ""
    peak_tflops: float = Field(..., gt=0, description="dense peak, 10^12 FLOP/s, at `precision`")
    precision: str = Field(..., min_length=1, description="the precision the peak is quoted at")
    memory_bandwidth_gb_s: float = Field(..., gt=0, description="10^9 bytes/s per device")
    bandwidth_note: str = ""
    memory_gb: float = Field(..., gt=0, description="10^9 bytes per device")
    projection: bool = Field(False, description="true: not generally available, figures are projected")
    sources: list[str] = Field(..., min_length=1, description="URLs or documents for the figures")

    @field_validator("sources")
    @classmethod
    def _sources_not_blank(cls, v: list[str]) -> list[str]:
        if any(not s.strip() for s in v):
            raise ValueError("a source is blank")
        return v

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def usd_per_second(self) -> float:
        return self.usd_per_hour / 3600.0

    @property
    def system_usd_per_hour(self) -> float | None:
        return self.usd_per_hour * self.system.devices if self.system else None


class _CatalogFile(_Strict):
    version: Literal[1] = 1
    as_of: str = ""
    currency: Literal["USD"] = "USD"
    hardware: list[Any] = Field(..., min_length=1)


class Catalog:
    """Entries by name; lookup also accepts aliases, any case, and a unique prefix."""

    def __init__(self, entries: list[Hardware], *, path: Path | None = None, as_of: str = ""):
        self.entries = list(entries)
        self.path = path
        self.as_of = as_of
        self._by_key: dict[str, Hardware] = {}
        for h in self.entries:
            for key in (h.name, *h.aliases):
                k = key.lower()
                other = self._by_key.get(k)
                if other is not None and other is not h:
                    raise CatalogError(f"{path or 'catalog'}: name or alias {key!r} is used by both "
                                       f"{other.name!r} and {h.name!r}")
                self._by_key[k] = h

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, name: str) -> bool:
        return self._find(name) is not None

    def names(self) -> list[str]:
        return [h.name for h in self.entries]

    def _find(self, name: str) -> Hardware | None:
        k = name.strip().lower()
        if k in self._by_key:
            return self._by_key[k]
        hits = {h.name: h for key, h in self._by_key.items() if key.startswith(k)} if k else {}
        return next(iter(hits.values())) if len(hits) == 1 else None

    def get(self, name: str) -> Hardware:
        h = self._find(name)
        if h is None:
            raise CatalogError(f"unknown hardware {name!r} in {self.path or 'catalog'}; "
                               f"known: {', '.join(self.names())}")
        return h


def _field_path(loc: tuple) -> str:
    return ".".join(str(p) for p in loc) or "(entry)"


def parse_catalog(data: Any, source: str = "catalog") -> Catalog:
    """Validate already-parsed YAML (a mapping with a `hardware` list)."""
    if not isinstance(data, dict):
        raise CatalogError(f"{source}: expected a mapping with a 'hardware' list, got {type(data).__name__}")
    try:
        top = _CatalogFile.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        raise CatalogError(f"{source}: field {_field_path(err['loc'])}: {err['msg']}") from None
    entries, seen = [], set()
    for i, raw in enumerate(top.hardware):
        label = f"entry {i}"
        if isinstance(raw, dict) and isinstance(raw.get("name"), str):
            label += f" ({raw['name']})"
        if not isinstance(raw, dict):
            raise CatalogError(f"{source}: {label}: expected a mapping, got {type(raw).__name__}")
        try:
            h = Hardware.model_validate(raw)
        except ValidationError as e:
            problems = "; ".join(f"field {_field_path(err['loc'])}: {err['msg']}" for err in e.errors())
            raise CatalogError(f"{source}: {label}: {problems}") from None
        if h.name.lower() in seen:
            raise CatalogError(f"{source}: {label}: field name: duplicate name {h.name!r}")
        seen.add(h.name.lower())
        entries.append(h)
    return Catalog(entries, path=Path(source) if source != "catalog" else None, as_of=top.as_of)


def catalog_path(path: str | Path | None = None) -> Path:
    """The file `load_catalog` reads: `path`, else $FLYWHEEL_HARDWARE, else the shipped one."""
    if path is not None:
        return Path(path)
    env = os.environ.get(ENV_VAR, "").strip()
    return Path(env) if env else SHIPPED


def load_catalog(path: str | Path | None = None) -> Catalog:
    p = catalog_path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise CatalogError(f"{p}: cannot read hardware catalog: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise CatalogError(f"{p}: not valid YAML: {e}") from None
    return parse_catalog(data, str(p))
