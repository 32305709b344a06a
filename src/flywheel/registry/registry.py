"""The model registry: versions with lineage, exactly one production version, promotion history.

Layout under the registry root (default ./flywheel-data/registry, or $FLYWHEEL_DATA_DIR/registry):
`registry.db` (SQLite, WAL) and `models/<id>/`, one Hugging Face folder per version.
`Registry(url=...)` keeps the records in any SQLAlchemy database instead (PostgreSQL when
several machines share a registry); the model folders stay under the root.

`promote` is one write transaction (archive the old production version, mark the new one, a
history row, the marker servers poll), so a crash leaves the old state or the new one, never a
mix; a partial unique index refuses a second production row outright (why a database:
docs/architecture.md, "Stores of the outer loop are databases"). Model folders are copied (or
hard-linked, `link=True`), so the registry's copy survives deletion of the run folder; each
version records its files' sizes and SHA-256 for `verify(id)`. A crash mid-registration leaves
at worst an unreferenced folder, which the next registration removes. `prune(id)` removes a
rejected version's files and keeps its record, marked pruned (the loop's retention does it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, insert, select, update
from sqlalchemy.engine import make_url

from flywheel.clock import utc_aware, utc_naive, utc_now
from flywheel.closing import Closing
from flywheel.crash_points import crash_point
from flywheel.database import open_engine, writing
from flywheel.files import fsync_dir
from flywheel.locations import data_dir
from flywheel.process import pid_alive
from flywheel.registry.storage import (
    SCHEMA,
    STATUSES,
    HistoryEntry,
    HistoryRow,
    ProductionMarker,
    PrunedRow,
    RegistryError,
    StateRow,
    StatusError,
    Version,
    VersionNotFound,
    VersionRow,
    copy_folder,
    json_dict,
    model_folder,
    sha256,
)


def default_root() -> Path:
    """$FLYWHEEL_DATA_DIR/registry (or the older $FLYWHEEL_DATA), else ./flywheel-data/registry."""
    return data_dir() / "registry"


class Registry(Closing):
    """Model versions in a folder (`root`) or a SQLAlchemy database (`url`, or a URL as `root`).

    Safe to share between threads; several processes may open the same registry.
    """

    def __init__(self, root: str | Path | None = None, *, url: str | None = None):
        if isinstance(root, str) and "://" in root:
            root, url = None, root
        if root is None and url is not None and make_url(url).get_backend_name() == "sqlite":
            database = make_url(url).database or ""
            if database not in ("", ":memory:"):
                root = Path(database).expanduser().parent
        self.root = Path(root if root is not None else default_root()).expanduser().resolve()
        self.models = self.root / "models"
        self.models.mkdir(parents=True, exist_ok=True)
        self.engine = open_engine(url or f"sqlite:///{self.root / 'registry.db'}")
        self.url = self.engine.url.render_as_string(hide_password=True)
        try:
            self._ensure_schema()
        except BaseException:
            self.engine.dispose()
            raise

    def close(self) -> None:
        self.engine.dispose()

    def __repr__(self) -> str:
        return f"Registry({str(self.root)!r}, url={self.url!r})"

    # ---- reading

    def get(self, id: str) -> Version:
        with self._reading() as conn:
            return self._version(conn, self._row(conn, id))

    def list(self, *, status: str | None = None, cycle: str | None = None) -> list[Version]:
        """All versions in registration order, optionally only those of one status or cycle."""
        query = select(VersionRow).order_by(VersionRow.seq)
        if status is not None and status not in STATUSES:
            raise RegistryError(f"unknown status {status!r} (one of: {', '.join(STATUSES)})")
        if status is not None:
            query = query.where(VersionRow.status == status)
        if cycle is not None:
            query = query.where(VersionRow.cycle == str(cycle))
        with self._reading() as conn:
            pruned = {p.version: p for p in conn.execute(select(PrunedRow))}
            return [self._version(conn, r, pruned) for r in conn.execute(query)]

    def production(self) -> Version | None:
        with self._reading() as conn:
            pid = conn.scalar(select(StateRow.production).where(StateRow.id == 1))
            return None if pid is None else self._version(conn, self._row(conn, pid))

    def production_marker(self) -> ProductionMarker:
        """(production id, generation): one primary-key read; poll it and reload when it changes."""
        with self.engine.connect() as conn:
            row = conn.execute(select(StateRow.production, StateRow.generation).where(StateRow.id == 1)).one()
        return ProductionMarker(row.production, row.generation)

    def history(self) -> list[HistoryEntry]:
        with self._reading() as conn:
            rows = conn.execute(select(HistoryRow).order_by(HistoryRow.seq)).all()
        return [HistoryEntry(r.seq, utc_aware(r.at), r.action, r.version, r.previous, r.reason, r.generation)
                for r in rows]

    def lineage(self, id: str) -> list[Version]:
        """`id`, its parent, the parent's parent ... up to a version without a parent."""
        out: list[Version] = []
        with self._reading() as conn:
            next_id: str | None = id
            while next_id is not None:
                out.append(self._version(conn, self._row(conn, next_id)))
                next_id = out[-1].parent
        return out

    def verify(self, id: str) -> list[str]:
        """Problems with a version's files (missing, resized, changed content); empty when intact.
        A pruned version has one: that its files were pruned, when and why."""
        version = self.get(id)
        if version.pruned:
            return [f"model files pruned {version.pruned_at:%Y-%m-%d %H:%M:%S} UTC ({version.pruned_reason})"]
        problems = []
        for rel, (size, digest) in sorted(version.files.items()):
            f = version.path / rel
            if not f.is_file():
                problems.append(f"{rel}: missing")
            elif f.stat().st_size != size:
                problems.append(f"{rel}: {f.stat().st_size} bytes, registered with {size}")
            elif sha256(f) != digest:
                problems.append(f"{rel}: content changed since registration")
        return problems

    # ---- writing

    def register(self, model_dir: str | Path, *, parent: str | None = None, cycle: str | int | None = None,
                 data_counts: Mapping[str, Any] | None = None, config: Mapping[str, Any] | None = None,
                 eval_scores: Mapping[str, Any] | None = None, cost: Mapping[str, Any] | None = None,
                 notes: str = "", key: str | None = None, link: bool = False) -> Version:
        """Store a copy (or hard links, `link=True`) of `model_dir` as a new candidate version.

        Hard links cost no disk, but a program that rewrites a source file in place (open with
        truncation) changes the registry's file too; flywheel's checkpoints write new files and
        rename them, so they are safe. The folder is copied into `models/.incoming-<pid>-*`,
        flushed, and renamed to `models/<id>` inside the transaction that inserts its row.
        Trainer state (`trainer_state.pt`) and hidden `.tmp-*` folders are skipped.

        `key` makes the call idempotent: registering again with a key already stored returns
        that version and copies nothing (a resumed cycle cannot register its model twice).
        """
        source = model_folder(model_dir)
        fields = {"data_counts": json_dict("data_counts", data_counts), "config": json_dict("config", config),
                  "eval_scores": json_dict("eval_scores", eval_scores), "cost": json_dict("cost", cost)}
        if key is not None and (found := self._by_key(key)) is not None:
            return found
        if parent is not None:
            self.get(parent)  # fail before copying gigabytes
        self._sweep()
        incoming = self.models / f".incoming-{os.getpid()}-{uuid.uuid4().hex}"
        try:
            files, storage = copy_folder(source, incoming, link=link)
            crash_point("register:copied")
            with writing(self.engine) as conn:
                self._lock(conn)
                if key is not None and (row := conn.execute(select(VersionRow).where(VersionRow.key == key)).first()):
                    return self._version(conn, row)  # another process won the race
                if parent is not None:
                    self._row(conn, parent)
                seq = (conn.scalar(select(VersionRow.seq).order_by(VersionRow.seq.desc()).limit(1)) or 0) + 1
                vid = f"v{seq}"
                dest = self.models / vid
                if dest.exists():  # left by a registration killed before its commit: no row names it
                    shutil.rmtree(dest)
                os.rename(incoming, dest)
                fsync_dir(self.models)
                crash_point("register:renamed")
                conn.execute(insert(VersionRow).values(
                    seq=seq, id=vid, key=key, created_at=utc_naive(utc_now()), path=f"models/{vid}", source=str(source),
                    storage=storage, parent=parent, cycle=None if cycle is None else str(cycle),
                    status="candidate", reasons=[], files=files, notes=notes or "", **fields))
            return self.get(vid)
        finally:
            shutil.rmtree(incoming, ignore_errors=True)

    def update(self, id: str, *, eval_scores: Mapping[str, Any] | None = None,
               cost: Mapping[str, Any] | None = None, data_counts: Mapping[str, Any] | None = None,
               notes: str | None = None) -> Version:
        """Merge scores, costs or counts measured after registration into a version's record."""
        with writing(self.engine) as conn:
            row = self._row(conn, id)
            values: dict[str, Any] = {}
            for name, new in (("eval_scores", eval_scores), ("cost", cost), ("data_counts", data_counts)):
                if new is not None:
                    values[name] = {**getattr(row, name), **json_dict(name, new)}
            if notes is not None:
                values["notes"] = notes
            if values:
                conn.execute(update(VersionRow).where(VersionRow.id == id).values(**values))
        return self.get(id)

    def promote(self, id: str, reason: str = "") -> Version:
        """Make `id` the production version, archiving the current one, in one transaction
        (BEGIN IMMEDIATE on SQLite, so concurrent promoters queue; the `registry_state` row is
        locked FOR UPDATE on PostgreSQL).

        Promoting the current production version is a no-op (nothing recorded). A rejected
        version cannot be promoted, nor a pruned one (its files are gone).
        """
        with writing(self.engine) as conn:
            current = self._lock(conn)
            row = self._row(conn, id)
            if current == id:
                return self._version(conn, row)
            self._refuse_pruned(conn, id, "promoted")
            if row.status == "rejected":
                raise StatusError(f"version {id} is rejected ({'; '.join(row.reasons) or 'no reason given'}); "
                                  "a rejected version cannot be promoted")
            self._switch(conn, current, id, "promote", reason)
        crash_point("promote:committed")
        return self.get(id)

    def rollback(self, to: str | None = None, reason: str = "") -> Version:
        """Put an earlier production version back into production (recorded as a rollback).

        Default target: the version the current production replaced when it was last
        promoted, so repeated rollbacks walk back through the promotions. `to` may name any
        version that was in production before.
        """
        with writing(self.engine) as conn:
            current = self._lock(conn)
            if current is None:
                raise StatusError("no version is in production; there is nothing to roll back")
            if to is None:
                to = self._replaced(conn, current)
                if to is None:
                    raise StatusError(f"production version {current} replaced no earlier version; "
                                      "nothing to roll back to (name one with --to)")
            row = self._row(conn, to)
            if to == current:
                return self._version(conn, row)
            self._refuse_pruned(conn, to, "rolled back to")
            if not conn.scalar(select(HistoryRow.seq).where(HistoryRow.version == to,
                                                           HistoryRow.action != "reject").limit(1)):
                raise StatusError(f"version {to} was never in production; promote it instead of rolling back")
            if row.status == "rejected":
                raise StatusError(f"version {to} is rejected ({'; '.join(row.reasons)}); "
                                  "cannot roll back to it")
            self._switch(conn, current, to, "rollback", reason or f"rollback from {current}")
        crash_point("rollback:committed")
        return self.get(to)

    def reject(self, id: str, reasons: str | Iterable[str]) -> Version:
        """Mark `id` rejected with its reasons (added to any it had). Production cannot be rejected."""
        reasons = [reasons] if isinstance(reasons, str) else [str(r) for r in reasons]
        reasons = [r.strip() for r in reasons if r and r.strip()]
        if not reasons:
            raise RegistryError(f"rejecting {id} needs at least one reason")
        with writing(self.engine) as conn:
            current = self._lock(conn)
            row = self._row(conn, id)
            if id == current:
                raise StatusError(f"version {id} is in production; promote or roll back to another version "
                                  "before rejecting it")
            merged = list(dict.fromkeys([*(row.reasons or []), *reasons]))
            if row.status == "rejected" and merged == row.reasons:
                return self._version(conn, row)
            conn.execute(update(VersionRow).where(VersionRow.id == id).values(status="rejected", reasons=merged))
            generation = conn.scalar(select(StateRow.generation).where(StateRow.id == 1))
            conn.execute(insert(HistoryRow).values(at=utc_naive(utc_now()), action="reject", version=id, previous=None,
                                                   reason="; ".join(reasons), generation=generation))
        return self.get(id)

    def rollback_target(self) -> str | None:
        """What `rollback()` without `to` would restore: the version production replaced when
        it was last promoted (None: nothing in production, or it replaced nothing)."""
        with self._reading() as conn:
            current = conn.scalar(select(StateRow.production).where(StateRow.id == 1))
            return None if current is None else self._replaced(conn, current)

    def prune(self, id: str, reason: str) -> Version:
        """Remove a rejected version's model files; its record (scores, reasons, lineage,
        history) stays, marked pruned with `reason`, and it can no longer be promoted or rolled
        back to. Any other status is refused (StatusError): production, archived versions (the
        rollback targets) and candidates keep their files.

        The mark commits before a file goes and the folder is renamed to a hidden name before
        it is removed, so a crash leaves a marked version with its folder whole (pruning it
        again removes it) or hidden (the next prune or registration removes it), never an
        unmarked one with files missing."""
        if not reason.strip():
            raise RegistryError(f"pruning {id} needs a reason")
        with writing(self.engine) as conn:
            self._lock(conn)
            row = self._row(conn, id)
            if row.status != "rejected":
                raise StatusError(f"version {id} is {row.status}; only a rejected version can be pruned")
            if self._mark(conn, id) is None:
                conn.execute(insert(PrunedRow).values(version=id, at=utc_naive(utc_now()), reason=reason.strip(),
                                                      bytes=sum(size for size, _ in row.files.values())))
        crash_point("prune:marked")
        folder, hidden = self.root / row.path, self.models / f".pruned-{id}"
        if folder.exists():  # a hidden folder of this id is not there: it is named after this rename
            os.rename(folder, hidden)
            fsync_dir(self.models)
        crash_point("prune:hidden")
        self._sweep()
        return self.get(id)

    # ---- internals

    def _version(self, conn: Connection, row: VersionRow, pruned: Mapping[str, Any] | None = None) -> Version:
        """The record of `row` with its pruning mark, looked up or taken from `pruned` (id -> mark)."""
        return Version.from_row(row, self.root, pruned.get(row.id) if pruned is not None else self._mark(conn, row.id))

    def _mark(self, conn: Connection, id: str):
        return conn.execute(select(PrunedRow).where(PrunedRow.version == id)).first()

    def _refuse_pruned(self, conn: Connection, id: str, what: str) -> None:
        if (mark := self._mark(conn, id)) is not None:
            raise StatusError(f"version {id} cannot be {what}: its model files were pruned "
                              f"{utc_aware(mark.at):%Y-%m-%d %H:%M:%S} UTC ({mark.reason}); only its record is left")

    def _replaced(self, conn: Connection, current: str) -> str | None:
        """The version `current` replaced when it was last promoted."""
        return conn.scalar(select(HistoryRow.previous).where(
            HistoryRow.action == "promote", HistoryRow.version == current).order_by(HistoryRow.seq.desc()).limit(1))

    def _switch(self, conn: Connection, current: str | None, new: str, action: str, reason: str) -> None:
        """The four writes of a change of production, inside the caller's transaction."""
        crash_point(f"{action}:locked")
        if current is not None:
            conn.execute(update(VersionRow).where(VersionRow.id == current).values(status="archived"))
        crash_point(f"{action}:archived")
        conn.execute(update(VersionRow).where(VersionRow.id == new).values(status="production"))
        crash_point(f"{action}:marked")
        generation = conn.scalar(select(StateRow.generation).where(StateRow.id == 1)) + 1
        conn.execute(insert(HistoryRow).values(at=utc_naive(utc_now()), action=action, version=new, previous=current,
                                               reason=reason or "", generation=generation))
        crash_point(f"{action}:logged")
        conn.execute(update(StateRow).where(StateRow.id == 1).values(production=new, generation=generation))
        crash_point(f"{action}:state")

    @contextlib.contextmanager
    def _reading(self) -> Iterator[Connection]:
        with self.engine.connect() as conn, conn.begin():  # one snapshot for several reads
            yield conn

    def _lock(self, conn: Connection) -> str | None:
        """Lock the state row (PostgreSQL; SQLite's BEGIN IMMEDIATE already holds the write lock)."""
        return conn.execute(select(StateRow.production).where(StateRow.id == 1).with_for_update()).scalar_one()

    def _row(self, conn: Connection, id: str) -> VersionRow:
        row = conn.execute(select(VersionRow).where(VersionRow.id == str(id))).first()
        if row is None:
            known = conn.scalars(select(VersionRow.id).order_by(VersionRow.seq)).all()
            listing = ", ".join(known[-10:]) if known else "none registered yet"
            raise VersionNotFound(f"unknown model version {id!r} in {self.root} (versions: {listing})")
        return row

    def _by_key(self, key: str) -> Version | None:
        with self._reading() as conn:
            row = conn.execute(select(VersionRow).where(VersionRow.key == key)).first()
            return None if row is None else self._version(conn, row)

    def _sweep(self) -> None:
        """Remove copies left by registrations whose process is gone, and the hidden folders of
        versions a crash left half pruned (named only after their mark committed)."""
        for d in self.models.glob(".pruned-*"):
            shutil.rmtree(d, ignore_errors=True)
        for d in self.models.glob(".incoming-*"):
            with contextlib.suppress(ValueError, IndexError):
                pid = int(d.name.split("-")[1])
                if not pid_alive(pid):
                    shutil.rmtree(d, ignore_errors=True)

    def _ensure_schema(self) -> None:
        SCHEMA.upgrade(self.engine)  # its first revision writes the registry_state row
