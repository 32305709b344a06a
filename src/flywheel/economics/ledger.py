"""Cost ledger: one append-only record per stage execution, stored as JSONL.

A record says what a stage ran on (`hardware` from the catalog, `devices` of it), for how
long (`seconds`, wall clock), what it produced (tokens generated, trained, served) and what
it cost: `usd = devices x seconds x usd_per_hour / 3600`, computed when the record is made
unless given, and frozen together with the price used (`usd_per_hour`), so a later price
edit in the catalog never rewrites history.

Storage: one JSON object per line. An append is a single write(2) on a file opened with
O_APPEND under an exclusive flock, so concurrent writers (threads or processes) never
interleave; a line left half-written by a crash is closed off before the next append, so it
stays one corrupt line that `read_ledger` reports as file:line. Reading raises on a corrupt
line; `skip_corrupt=True` skips it with a warning naming file:line — never silently.
fsync after each append is optional (`fsync=True`).

In memory: `Ledger(path=None)` keeps records in a list; `Ledger.stage(...)` times a block:

    with ledger.stage("rl_train", hardware="cpu-2core", cycle="c1") as rec:
        ...
        rec.tokens_trained += n
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from flywheel.economics.catalog import Catalog, load_catalog

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None



class LedgerError(ValueError):
    """A ledger file or record is invalid; the message names file:line where there is one."""


class LedgerWarning(UserWarning):
    """A corrupt ledger line was skipped (only with skip_corrupt=True)."""


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def compute_usd(devices: int, seconds: float, usd_per_hour: float) -> float:
    """Device-seconds x price per device-hour / 3600."""
    return devices * seconds * usd_per_hour / 3600.0


class CostRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    stage: str = Field(..., pattern=r"^[a-z][a-z0-9_]*$",
                       description="sft, rl_rollout, rl_train, dpo, eval, serve, curation, ...")
    hardware: str = Field(..., min_length=1, description="catalog entry name")
    devices: int = Field(1, ge=1, description="how many catalog devices the stage held")
    seconds: float = Field(..., ge=0, description="wall-clock seconds the devices were held")
    usd: float = Field(..., ge=0, description="cost in US dollars")
    usd_per_hour: float | None = Field(None, gt=0, description="price used to compute usd; null if usd was given")
    run: str | None = None
    cycle: str | None = None
    tokens_generated: int = Field(0, ge=0, description="sampled tokens (rollouts, eval)")
    tokens_trained: int = Field(0, ge=0, description="tokens in the loss (SFT, DPO, RL updates)")
    tokens_served: int = Field(0, ge=0, description="completion tokens returned to users")
    params: int | None = Field(None, ge=1, description="model parameters, for FLOP-based projections")
    timestamp: str = Field(default_factory=now_iso, description="ISO 8601, when the stage started")
    extra: dict[str, Any] = Field(default_factory=dict)
    key: str | None = Field(None, description=(
        "idempotency key: a record whose key the ledger already holds is not appended again"))

    @field_validator("timestamp")
    @classmethod
    def _iso(cls, v: str) -> str:
        datetime.fromisoformat(v)  # raises ValueError on a malformed timestamp
        return v

    @property
    def device_seconds(self) -> float:
        return self.devices * self.seconds

    def to_json(self) -> str:
        return json.dumps(self.model_dump(), separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def make_record(stage: str, *, hardware: str, seconds: float, devices: int = 1, usd: float | None = None,
                catalog: Catalog | None = None, **fields: Any) -> CostRecord:
    """Build a record; when `usd` is None it is computed from the catalog price of `hardware`."""
    price = None
    if usd is None:
        entry = (catalog if catalog is not None else load_catalog()).get(hardware)
        hardware, price = entry.name, entry.usd_per_hour
        usd = compute_usd(devices, seconds, price)
    try:
        return CostRecord(stage=stage, hardware=hardware, devices=devices, seconds=seconds, usd=usd,
                          usd_per_hour=price, **fields)
    except ValidationError as e:
        raise LedgerError(_describe(e)) from None


def _describe(e: ValidationError) -> str:
    return "; ".join(f"field {'.'.join(map(str, err['loc'])) or '(record)'}: {err['msg']}" for err in e.errors())


# ---------------------------------------------------------------- file storage


def append_line(path: Path, line: str, *, fsync: bool = False, unless_key: str | None = None) -> bool:
    """Append one line atomically (O_APPEND, one write, exclusive flock). With `unless_key`,
    append only if no JSON line of the file has that "key" (checked under the same lock).
    Returns whether it appended."""
    if "\n" in line:
        raise LedgerError("a ledger line cannot contain a newline")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        if unless_key is not None and size and _holds_key(os.pread(fd, size, 0), unless_key):
            return False
        data = (line + "\n").encode("utf-8")
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data  # close off a line a crashed writer left without its newline
        written = os.write(fd, data)
        if written != len(data):  # pragma: no cover - regular files write whole buffers
            raise LedgerError(f"{path}: short write ({written} of {len(data)} bytes)")
        if fsync:
            os.fsync(fd)
        return True
    finally:
        os.close(fd)  # also releases the flock


def _holds_key(text: bytes, key: str) -> bool:
    needle = json.dumps(key).encode()
    for line in text.splitlines():
        if needle in line:  # cheap filter before parsing
            try:
                if json.loads(line).get("key") == key:
                    return True
            except (ValueError, AttributeError):
                continue  # a corrupt line holds no key
    return False


def read_ledger(path: str | Path, *, skip_corrupt: bool = False) -> list[CostRecord]:
    """All records of a JSONL ledger, in file order. Blank lines are ignored.

    A line that is not JSON or not a valid record raises `LedgerError` ("file:line: why");
    with `skip_corrupt=True` it is skipped and a `LedgerWarning` names it instead.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        raise LedgerError(f"{p}: no such ledger file") from None
    records = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
            records.append(CostRecord.model_validate(obj))
        except ValidationError as e:
            _bad(f"{p}:{lineno}: {_describe(e)}", skip_corrupt)
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            _bad(f"{p}:{lineno}: not a valid record: {e}", skip_corrupt)
    return records


def _bad(msg: str, skip: bool) -> None:
    if not skip:
        raise LedgerError(msg + " (skip_corrupt=True / --skip-corrupt skips such lines with a warning)")
    warnings.warn(f"skipped corrupt ledger line {msg}", LedgerWarning, stacklevel=3)


# ---------------------------------------------------------------- the API stages use


@dataclass
class StageRecord:
    """Mutable while its `with` block runs; `record` holds the CostRecord afterwards."""

    stage: str
    hardware: str
    devices: int = 1
    run: str | None = None
    cycle: str | None = None
    params: int | None = None
    tokens_generated: int = 0
    tokens_trained: int = 0
    tokens_served: int = 0
    usd: float | None = None  # set to override the computed cost
    extra: dict[str, Any] = field(default_factory=dict)
    record: CostRecord | None = None


class Ledger:
    """Records cost; on disk (`path`) as JSONL, or in memory when `path` is None.

    `records` holds what this object appended (and, for a file ledger, nothing older:
    `read()` gives the whole file).
    """

    def __init__(self, path: str | Path | None = None, *, catalog: Catalog | None = None, fsync: bool = False):
        self.path = Path(path) if path is not None else None
        self.fsync = fsync
        self._catalog = catalog
        self._lock = threading.Lock()
        self.records: list[CostRecord] = []

    @property
    def catalog(self) -> Catalog:
        if self._catalog is None:
            self._catalog = load_catalog()
        return self._catalog

    def append(self, record: CostRecord) -> CostRecord:
        """Append `record`, unless it has a key the ledger already holds (then it is dropped:
        a retried stage never counts twice). Returns the record."""
        with self._lock:
            if self.path is not None:
                appended = append_line(self.path, record.to_json(), fsync=self.fsync, unless_key=record.key)
            else:
                appended = record.key is None or all(r.key != record.key for r in self.records)
            if appended:
                self.records.append(record)
        return record

    def record(self, stage: str, *, hardware: str, seconds: float, devices: int = 1,
               usd: float | None = None, **fields: Any) -> CostRecord:
        """Make a record (usd from the catalog unless given) and append it."""
        catalog = None if usd is not None else self.catalog
        return self.append(make_record(stage, hardware=hardware, seconds=seconds, devices=devices, usd=usd,
                                       catalog=catalog, **fields))

    @contextlib.contextmanager
    def stage(self, stage: str, *, hardware: str, devices: int = 1, cycle: str | None = None,
              run: str | None = None, params: int | None = None,
              extra: dict[str, Any] | None = None) -> Iterator[StageRecord]:
        """Time the block and append its record on exit, also when the block raises
        (the devices were held all the same; `extra["error"]` names the exception)."""
        self.catalog.get(hardware)  # fail before the work, not after it
        rec = StageRecord(stage=stage, hardware=hardware, devices=devices, run=run, cycle=cycle,
                          params=params, extra=dict(extra or {}))
        started, t0 = now_iso(), time.perf_counter()
        try:
            yield rec
        except BaseException as e:
            rec.extra["error"] = type(e).__name__
            raise
        finally:
            rec.record = self.record(
                rec.stage, hardware=rec.hardware, seconds=time.perf_counter() - t0, devices=rec.devices,
                usd=rec.usd, run=rec.run, cycle=rec.cycle, params=rec.params, timestamp=started,
                tokens_generated=rec.tokens_generated, tokens_trained=rec.tokens_trained,
                tokens_served=rec.tokens_served, extra=rec.extra)

    def read(self, *, skip_corrupt: bool = False) -> list[CostRecord]:
        if self.path is None:
            with self._lock:
                return list(self.records)
        if not self.path.exists():
            return []
        return read_ledger(self.path, skip_corrupt=skip_corrupt)
