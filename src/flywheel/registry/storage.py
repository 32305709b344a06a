"""How the model registry stores things: its tables, the records it hands back, the model folders.

`registry_versions` holds one row per registered model; `status` is candidate, production,
archived or rejected, and a partial unique index admits at most one production row, so
even a bug cannot make two. `registry_state` is a single row (id 1): the production id and
a generation counter bumped by every change of production (the marker servers poll).
`registry_history` logs every promote, rollback and reject. `registry_pruned` marks the
rejected versions whose model files were removed (`Registry.prune`): when, why, how many bytes;
their rows stay. It is a table of its own (registry/migrations/0002), so a registry made
before it existed gets it when opened. Times are naive UTC in the database and timezone-aware UTC in the
records.

Model folders, and LoRA adapter folders over one, are checked by flywheel's one rule
(`models.loading.check_servable_folder`), then
copied or hard-linked file by file with each file's size and SHA-256 recorded, and flushed
to disk before the caller renames the folder into place.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, NamedTuple

import orjson
from sqlalchemy import DateTime, ForeignKey, Index, Integer, String, Text, text
from sqlalchemy.orm import Mapped, mapped_column

from flywheel.clock import utc_aware
from flywheel.database import Base, json_column
from flywheel.files import fsync_dir
from flywheel.migrations import Schema
from flywheel.models.loading import ModelLoadError, check_servable_folder

Status = Literal["candidate", "production", "archived", "rejected"]
Action = Literal["promote", "rollback", "reject"]
STATUSES: tuple[str, ...] = ("candidate", "production", "archived", "rejected")

SKIP_FILES = frozenset({"trainer_state.pt"})  # a checkpoint's optimizer/RNG state is not the model
_CHUNK = 1 << 20


class VersionRow(Base):
    __tablename__ = "registry_versions"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    key: Mapped[str | None] = mapped_column(String(255), unique=True)  # idempotency key of register()
    created_at: Mapped[datetime] = mapped_column(DateTime)
    path: Mapped[str] = mapped_column(Text)  # model folder, relative to the registry root
    source: Mapped[str] = mapped_column(Text)  # the folder it was registered from
    storage: Mapped[str] = mapped_column(String(16))  # copy | hardlink | mixed
    parent: Mapped[str | None] = mapped_column(ForeignKey("registry_versions.id"), index=True)
    cycle: Mapped[str | None] = mapped_column(String(200), index=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    reasons: Mapped[list[str]] = mapped_column(json_column())
    data_counts: Mapped[dict[str, Any]] = mapped_column(json_column())
    config: Mapped[dict[str, Any]] = mapped_column(json_column())
    eval_scores: Mapped[dict[str, Any]] = mapped_column(json_column())
    cost: Mapped[dict[str, Any]] = mapped_column(json_column())
    files: Mapped[dict[str, Any]] = mapped_column(json_column())  # relative path -> [size, sha256]
    notes: Mapped[str] = mapped_column(Text)

    __table_args__ = (
        Index("registry_one_production", "status", unique=True,
              sqlite_where=text("status = 'production'"), postgresql_where=text("status = 'production'")),
    )


class StateRow(Base):
    __tablename__ = "registry_state"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    production: Mapped[str | None] = mapped_column(ForeignKey("registry_versions.id"))
    generation: Mapped[int] = mapped_column(Integer)


class HistoryRow(Base):
    __tablename__ = "registry_history"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(DateTime)
    action: Mapped[str] = mapped_column(String(16))
    version: Mapped[str] = mapped_column(ForeignKey("registry_versions.id"), index=True)
    previous: Mapped[str | None] = mapped_column(ForeignKey("registry_versions.id"))
    reason: Mapped[str] = mapped_column(Text)
    generation: Mapped[int] = mapped_column(Integer)


class PrunedRow(Base):
    __tablename__ = "registry_pruned"

    version: Mapped[str] = mapped_column(ForeignKey("registry_versions.id"), primary_key=True)
    at: Mapped[datetime] = mapped_column(DateTime)
    reason: Mapped[str] = mapped_column(Text)
    bytes: Mapped[int] = mapped_column(Integer)  # the registered files' sizes, freed


SCHEMA = Schema("registry", Path(__file__).resolve().parent / "migrations",
                (VersionRow.__table__, StateRow.__table__, HistoryRow.__table__, PrunedRow.__table__),
                lock_key=7_312_001, legacy_key="registry.schema_version")


class RegistryError(ValueError):
    """A request the registry refuses; the message says why."""


class VersionNotFound(RegistryError):
    pass


class InvalidModelFolder(RegistryError):
    pass


class StatusError(RegistryError):
    """The version's status does not allow this (promote a rejected one, reject production...)."""


@dataclass(frozen=True)
class Version:
    """One registered model. `path` is its folder inside the registry (load it from there);
    a pruned version's folder is gone, its record stays."""

    id: str
    path: Path
    parent: str | None
    cycle: str | None
    created_at: datetime
    status: Status
    reasons: list[str] = field(default_factory=list)  # why it was rejected
    data_counts: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    eval_scores: dict[str, Any] = field(default_factory=dict)
    cost: dict[str, Any] = field(default_factory=dict)  # "usd" plus whatever else was measured
    notes: str = ""
    source: str = ""
    storage: str = "copy"
    files: dict[str, Any] = field(default_factory=dict, repr=False)  # relative path -> [size, sha256]
    key: str | None = None
    pruned_at: datetime | None = None  # its model files were removed then (the record stays)
    pruned_reason: str = ""

    @property
    def pruned(self) -> bool:
        return self.pruned_at is not None

    @property
    def size(self) -> int:
        """Bytes of its registered files (on disk unless pruned)."""
        return sum(size for size, _ in self.files.values())

    @property
    def usd(self) -> float | None:
        return self.cost.get("usd")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["path"], d["created_at"] = str(self.path), self.created_at.isoformat()
        d["pruned_at"] = self.pruned_at.isoformat() if self.pruned_at else None
        return d

    @classmethod
    def from_row(cls, row: VersionRow, root: Path, pruned: PrunedRow | None = None) -> Version:
        """The record of `row`; `pruned`: its registry_pruned row, if it has one."""
        return cls(id=row.id, path=root / row.path, parent=row.parent, cycle=row.cycle,
                   created_at=utc_aware(row.created_at), status=row.status, reasons=list(row.reasons or []),
                   data_counts=row.data_counts or {}, config=row.config or {}, eval_scores=row.eval_scores or {},
                   cost=row.cost or {}, notes=row.notes, source=row.source, storage=row.storage,
                   files=row.files or {}, key=row.key, pruned_at=utc_aware(pruned.at) if pruned else None,
                   pruned_reason=pruned.reason if pruned else "")


@dataclass(frozen=True)
class HistoryEntry:
    """A change of status: `version` became production (promote, rollback) or rejected (reject).

    `previous` is the production version it replaced (None for the first promotion and for
    rejections); `generation` the production marker's counter after the change.
    """

    seq: int
    at: datetime
    action: Action
    version: str
    previous: str | None
    reason: str
    generation: int


class ProductionMarker(NamedTuple):
    """What a server polls: `generation` changes whenever production changes, even back to an old id."""

    version: str | None
    generation: int


# ---- model folders


def model_folder(model_dir: str | Path) -> Path:
    """The resolved folder, if it holds a model or a LoRA adapter over one
    (`check_servable_folder`); else InvalidModelFolder."""
    try:
        check_servable_folder(model_dir)
    except ModelLoadError as e:
        raise InvalidModelFolder(str(e)) from None
    return Path(model_dir).expanduser().resolve()


def json_dict(name: str, value: Mapping[str, Any] | None) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise RegistryError(f"{name} must be a mapping, got {type(value).__name__}")
    try:
        return orjson.loads(orjson.dumps(dict(value), option=orjson.OPT_NON_STR_KEYS))
    except TypeError as e:
        raise RegistryError(f"{name} is not JSON-serialisable: {e}") from None


def _files(folder: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".tmp-"))
        for name in sorted(filenames):
            if name not in SKIP_FILES:
                yield Path(dirpath) / name


def copy_folder(src: Path, dest: Path, *, link: bool) -> tuple[dict[str, list], str]:
    """Copy (or hard-link) the files of `src` into `dest`, flushed; return {rel: [size, sha256]} and the mode."""
    files: dict[str, list] = {}
    linked = copied = 0
    for f in _files(src):
        rel = f.relative_to(src)
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if link:
            try:
                os.link(f.resolve(), target)
                files[rel.as_posix()] = [target.stat().st_size, sha256(target)]
                linked += 1
                continue
            except OSError:  # another file system, or links not allowed: copy this one
                pass
        files[rel.as_posix()] = _copy_file(f, target)
        copied += 1
    for d in sorted({p.parent for p in dest.rglob("*")} | {dest}, key=lambda p: len(p.parts), reverse=True):
        fsync_dir(d)
    return files, ("hardlink" if not copied else "copy" if not linked else "mixed")


def _copy_file(src: Path, dest: Path) -> list:
    h, size = hashlib.sha256(), 0
    with open(src, "rb") as fin, open(dest, "xb") as fout:
        while chunk := fin.read(_CHUNK):
            h.update(chunk)
            fout.write(chunk)
            size += len(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    os.chmod(dest, 0o444)  # the registry's copy is not for editing
    return [size, h.hexdigest()]


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()

