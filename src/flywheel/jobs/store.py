"""JobStore: the fine-tuning service's files, jobs, events and checkpoints, in one database.

Every read and write names the tenant; a row of another tenant is "not found", never
"forbidden", so ids cannot be probed. File contents live under `files_dir` (written to a
temporary name and renamed, then the row is inserted: a crash leaves at worst an orphan file,
never a row without its bytes).

Job lifecycle: `validating_files` -> `queued` (or `failed` with an error naming the bad lines)
-> `running` (claimed by a worker, which holds a lease it renews by `heartbeat`) ->
`succeeded` | `failed` | `cancelled`; `paused` from `queued` or `running` (the worker
checkpoints and lets go), back to `queued` by `resume`. A lease that runs out (the worker
died) lets the next `claim` take the job again; after `max_attempts` claims it fails instead.
`claim` is one write transaction: on SQLite BEGIN IMMEDIATE serialises claimers; on
PostgreSQL the candidate row is locked with SKIP LOCKED; on both, the UPDATE re-checks the
claimable condition, so two workers never hold one job.
"""

from __future__ import annotations

import os
import secrets
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO

from sqlalchemy import Select, bindparam, delete, func, insert, or_, select, update

from flywheel import database
from flywheel.clock import utc_naive, utc_now
from flywheel.database import writing
from flywheel.jobs.tables import SCHEMA, CheckpointRow, EventRow, FileRow, FlywheelRow, JobRow
from flywheel.jobs.upload import StagedUpload, stage_upload

ACTIVE = ("validating_files", "queued", "running", "paused")
TERMINAL = ("succeeded", "failed", "cancelled")
MAX_LIST = 100


class JobStoreError(Exception):
    status = 400
    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class NotFound(JobStoreError):
    status, code = 404, "not_found"


class Conflict(JobStoreError):
    status, code = 409, "conflict"


class LeaseLost(JobStoreError):
    """The job is no longer this worker's: its lease ran out and another worker claimed it,
    or it reached a terminal state."""

    status, code = 409, "lease_lost"


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def _now() -> datetime:
    return utc_naive(utc_now())


def _dict(row) -> dict[str, Any]:
    return dict(row._mapping)


class JobStore:
    def __init__(self, url: str, files_dir: str | Path, *, max_attempts: int = 3):
        self.engine = database.open_engine(url)
        self.files_dir = Path(files_dir)
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.max_attempts = max_attempts
        self.postgres = self.engine.dialect.name == "postgresql"
        # A page read of a WAL-mode SQLite file is brief and never waits for a writer, so the API
        # may run it on its event loop; a PostgreSQL read is a network round trip.
        self.reads_inline = not self.postgres
        SCHEMA.upgrade(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    # ------------------------------------------------------------------ files

    def find(self, kind: str, tenant: str, idempotency_key: str, request_hash: str) -> dict[str, Any] | None:
        """The file, job or flywheel (`kind`) an earlier request with this key made, or None; Conflict when
        the key came with another request."""
        table = {"file": FileRow, "job": JobRow, "flywheel": FlywheelRow}[kind]
        with self.engine.connect() as conn:
            row = conn.execute(select(table.__table__).where(table.tenant == tenant,
                                                             table.idempotency_key == idempotency_key)).first()
        if row is None:
            return None
        if row.request_hash != request_hash:
            raise Conflict(f"Idempotency-Key {idempotency_key!r} was used for another request", "idempotency_key")
        return _dict(row)

    def add_file(self, tenant: str, filename: str, purpose: str, staged: StagedUpload,
                 idempotency_key: str | None = None) -> dict[str, Any]:
        """Store an upload staged in `files_dir` (jobs/upload.py): renamed into place, then its row."""
        file_id = new_id("file")
        path = self.files_dir / file_id
        os.replace(staged.path, path)
        row = dict(id=file_id, tenant=tenant, purpose=purpose, filename=filename, bytes=staged.bytes,
                   lines=staged.rows, sha256=staged.sha256, created_at=_now(), idempotency_key=idempotency_key,
                   request_hash=staged.request_hash)
        try:
            with writing(self.engine) as conn:
                conn.execute(insert(FileRow).values(**row))
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return row

    def stage(self, source: BinaryIO, filename: str, purpose: str, *, max_bytes: int,
              max_line_bytes: int) -> StagedUpload:
        """`source` copied into a temporary file beside the stored ones and checked (jobs/upload.py)."""
        return stage_upload(source, self.files_dir, filename, purpose, max_bytes=max_bytes,
                            max_line_bytes=max_line_bytes)

    def get_file(self, tenant: str, file_id: str) -> dict[str, Any]:
        with self.engine.connect() as conn:
            row = conn.execute(select(FileRow.__table__).where(FileRow.id == file_id, FileRow.tenant == tenant)).first()
        if row is None:
            raise NotFound(f"no file {file_id!r}", "file_id")
        return _dict(row)

    def file_path(self, tenant: str, file_id: str) -> Path:
        self.get_file(tenant, file_id)
        return self.files_dir / file_id

    def list_files(self, tenant: str, *, purpose: str | None = None, after: str | None = None, limit: int = MAX_LIST,
                   ascending: bool = False) -> tuple[list[dict[str, Any]], bool]:
        equal = {"tenant": tenant, **({"purpose": purpose} if purpose else {})}
        with self.engine.connect() as conn:
            return _page(conn, FileRow, equal, after, limit, ascending)

    def delete_file(self, tenant: str, file_id: str) -> None:
        with writing(self.engine) as conn:
            if conn.execute(select(FileRow.id).where(FileRow.id == file_id, FileRow.tenant == tenant)).first() is None:
                raise NotFound(f"no file {file_id!r}", "file_id")
            user = conn.execute(select(JobRow.id).where(
                JobRow.status.in_(ACTIVE), or_(JobRow.training_file == file_id, JobRow.validation_file == file_id))
            ).first()
            if user is not None:
                raise Conflict(f"file {file_id} is used by job {user.id}, which has not finished; cancel it first",
                               "file_id")
            conn.execute(delete(FileRow).where(FileRow.id == file_id))
        (self.files_dir / file_id).unlink(missing_ok=True)

    # ------------------------------------------------------------------ jobs

    def create_job(self, tenant: str, **fields: Any) -> dict[str, Any]:
        """A job row in `validating_files` (fields: JobRow's columns); returns it."""
        row = dict(id=new_id("ftjob"), tenant=tenant, status="validating_files", created_at=_now(), attempts=0,
                   **fields)
        with writing(self.engine) as conn:
            conn.execute(insert(JobRow).values(**row))
            self._event(conn, row["id"], f"Validating training file: {fields['training_file']}")
        return self.get_job(tenant, row["id"])

    def get_job(self, tenant: str | None, job_id: str) -> dict[str, Any]:
        """The job (tenant None: whoever owns it, for workers)."""
        with self.engine.connect() as conn:
            return self._job(conn, tenant, job_id)

    def list_jobs(self, tenant: str, *, after: str | None = None, limit: int = 20,
                  metadata: dict[str, str] | None = None) -> tuple[list[dict[str, Any]], bool]:
        with self.engine.connect() as conn:
            rows, more = _page(conn, JobRow, {"tenant": tenant}, after, limit if not metadata else MAX_LIST * 10, False)
        if metadata:  # a JSON filter portable across SQLite and PostgreSQL: done here, on one tenant's jobs
            rows = [r for r in rows if all((r["metadata"] or {}).get(k) == v for k, v in metadata.items())]
            rows, more = rows[:limit], len(rows) > limit or more
        return rows, more

    def validating(self) -> list[dict[str, Any]]:
        """Every tenant's jobs in `validating_files`, oldest first (to check after a restart)."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(JobRow.__table__).where(JobRow.status == "validating_files")
                                .order_by(JobRow.created_at)).all()
        return [_dict(r) for r in rows]

    def set_validated(self, job_id: str, *, error: dict[str, Any] | None, hyperparameters: dict[str, Any] | None,
                      method: dict[str, Any] | None = None) -> None:
        """validating_files -> queued (the resolved method recorded) or failed with `error`."""
        with writing(self.engine) as conn:
            if error is not None:
                conn.execute(update(JobRow).where(JobRow.id == job_id, JobRow.status == "validating_files")
                             .values(status="failed", error=error, finished_at=_now()))
                self._event(conn, job_id, f"Validation failed: {error['message']}", level="error")
                return
            conn.execute(update(JobRow).where(JobRow.id == job_id, JobRow.status == "validating_files")
                         .values(status="queued", method=method))
            self._event(conn, job_id, "Files validated, job queued", data={"hyperparameters": hyperparameters})

    def cancel(self, tenant: str, job_id: str) -> dict[str, Any]:
        """Not yet running: cancelled now. Running: its worker stops it within a heartbeat."""
        with writing(self.engine) as conn:
            job = self._job(conn, tenant, job_id)
            if job["status"] in TERMINAL:
                raise Conflict(f"job {job_id} has already {job['status']}", "fine_tuning_job_id")
            if job["status"] == "running":
                conn.execute(update(JobRow).where(JobRow.id == job_id).values(control="cancel"))
                self._event(conn, job_id, "Cancellation requested")
            else:
                conn.execute(update(JobRow).where(JobRow.id == job_id)
                             .values(status="cancelled", finished_at=_now(), control=None))
                self._event(conn, job_id, "Job cancelled")
        return self.get_job(tenant, job_id)

    def pause(self, tenant: str, job_id: str) -> dict[str, Any]:
        with writing(self.engine) as conn:
            job = self._job(conn, tenant, job_id)
            if job["status"] == "running":
                conn.execute(update(JobRow).where(JobRow.id == job_id).values(control="pause"))
                self._event(conn, job_id, "Pause requested")
            elif job["status"] == "queued":
                conn.execute(update(JobRow).where(JobRow.id == job_id).values(status="paused"))
                self._event(conn, job_id, "Job paused")
            else:
                raise Conflict(f"only a queued or running job can be paused; job {job_id} is {job['status']}",
                               "fine_tuning_job_id")
        return self.get_job(tenant, job_id)

    def resume(self, tenant: str, job_id: str) -> dict[str, Any]:
        with writing(self.engine) as conn:
            job = self._job(conn, tenant, job_id)
            if job["status"] != "paused":
                raise Conflict(f"only a paused job can be resumed; job {job_id} is {job['status']}",
                               "fine_tuning_job_id")
            conn.execute(update(JobRow).where(JobRow.id == job_id).values(status="queued", control=None))
            self._event(conn, job_id, "Job resumed, queued")
        return self.get_job(tenant, job_id)

    def unfinished(self, tenant: str) -> int:
        """The tenant's jobs validating, queued, running or paused."""
        with self.engine.connect() as conn:
            return conn.scalar(select(func.count()).select_from(JobRow).where(JobRow.tenant == tenant,
                                                                             JobRow.status.in_(ACTIVE)))

    def fine_tuned_models(self, tenant: str) -> list[dict[str, Any]]:
        """The tenant's succeeded jobs that made a model, oldest first."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(JobRow.__table__).where(
                JobRow.tenant == tenant, JobRow.status == "succeeded", JobRow.fine_tuned_model.is_not(None),
                JobRow.model_deleted_at.is_(None)).order_by(JobRow.seq)).all()
        return [_dict(r) for r in rows]

    def fine_tuned_model_path(self, tenant: str, name: str) -> str | None:
        """The folder of the tenant's fine-tuned model or checkpoint called `name`, else None."""
        with self.engine.connect() as conn:
            path = conn.scalar(select(JobRow.model_path).where(
                JobRow.tenant == tenant, JobRow.fine_tuned_model == name, JobRow.status == "succeeded",
                JobRow.model_deleted_at.is_(None)))
            if path is None:
                path = conn.scalar(select(CheckpointRow.path).join(JobRow, JobRow.id == CheckpointRow.job_id).where(
                    JobRow.tenant == tenant, CheckpointRow.fine_tuned_model_checkpoint == name))
        return path

    def delete_model(self, tenant: str, name: str) -> str:
        """Mark the tenant's fine-tuned model `name` deleted (its job keeps the record); returns
        its folder, for the caller to remove. NotFound for a name the tenant has no model of."""
        with writing(self.engine) as conn:
            row = conn.execute(select(JobRow.id, JobRow.model_path, JobRow.method).where(
                JobRow.tenant == tenant, JobRow.fine_tuned_model == name, JobRow.model_deleted_at.is_(None))).first()
            if row is None:
                raise NotFound(f"no fine-tuned model {name!r}", "model")
            if row.method.get("type") == "flywheel":  # its folder is a version in the flywheel's registry
                raise Conflict(f"model {name!r} is a version of managed flywheel "
                               f"{row.method['flywheel']['flywheel_id']}; roll the flywheel back instead", "model")
            conn.execute(update(JobRow).where(JobRow.id == row.id).values(model_deleted_at=_now()))
            self._event(conn, row.id, f"Fine-tuned model {name} deleted")
        return row.model_path

    # ------------------------------------------------------------------ workers

    def claim(self, worker: str, lease_s: float, max_running: int | None = None) -> dict[str, Any] | None:
        """The oldest claimable job, now this worker's until its lease runs out; None if none.
        A job whose lease ran out `max_attempts` times fails instead of being claimed; the
        jobs of a tenant with `max_running` jobs held by live workers wait."""
        now = _now()
        claimable = or_(JobRow.status == "queued", (JobRow.status == "running") & (JobRow.lease_until < now))
        with writing(self.engine) as conn:
            while True:
                q = select(JobRow.id, JobRow.attempts, JobRow.status).where(claimable)
                if max_running is not None:
                    busy = (select(JobRow.tenant).where(JobRow.status == "running", JobRow.lease_until >= now)
                            .group_by(JobRow.tenant).having(func.count() >= max_running))
                    q = q.where(JobRow.tenant.not_in(busy))
                q = q.order_by(JobRow.seq).limit(1)
                if self.postgres:
                    q = q.with_for_update(skip_locked=True)
                row = conn.execute(q).first()
                if row is None:
                    return None
                if row.status == "running" and row.attempts >= self.max_attempts:
                    message = (f"the job's worker stopped without finishing {row.attempts} times "
                               f"(max_attempts={self.max_attempts}); the last checkpoint is kept")
                    conn.execute(update(JobRow).where(JobRow.id == row.id).values(
                        status="failed", finished_at=now, worker=None, lease_until=None,
                        error={"code": "worker_lost", "message": message, "param": None}))
                    self._event(conn, row.id, message, level="error")
                    continue
                done = conn.execute(update(JobRow).where(JobRow.id == row.id, claimable).values(
                    status="running", worker=worker, lease_until=now + timedelta(seconds=lease_s),
                    attempts=JobRow.attempts + 1, started_at=func.coalesce(JobRow.started_at, now)))
                if done.rowcount == 1:
                    resumed = " (resuming: its previous worker stopped)" if row.status == "running" else ""
                    self._event(conn, row.id, f"Fine-tuning job started on worker {worker}{resumed}")
                    break
        return self.get_job(None, row.id)

    def heartbeat(self, job_id: str, worker: str, lease_s: float) -> str | None:
        """Renew this worker's lease; returns what a client asked of the job ("cancel", "pause")
        or None. LeaseLost when the job is no longer this worker's."""
        with writing(self.engine) as conn:
            done = conn.execute(update(JobRow).where(JobRow.id == job_id, JobRow.worker == worker,
                                                     JobRow.status == "running")
                                .values(lease_until=_now() + timedelta(seconds=lease_s)))
            if done.rowcount != 1:
                raise LeaseLost(f"job {job_id} is no longer held by worker {worker}")
            return conn.scalar(select(JobRow.control).where(JobRow.id == job_id))

    def finish(self, job_id: str, worker: str, status: str, message: str, *, also=None, **fields: Any) -> None:
        """The worker lets go of its job: `succeeded`, `failed`, `cancelled`, or `paused` (back
        to a client's `resume`). fields: fine_tuned_model, model_path, error, trained_tokens,
        estimated_cost. `also`: a statement run in the same transaction (a managed flywheel's
        production moving with its cycle's job)."""
        if status not in TERMINAL + ("paused",):
            raise ValueError(f"a worker finishes a job as one of {TERMINAL + ('paused',)}, not {status!r}")
        values = dict(status=status, worker=None, lease_until=None, control=None, **fields)
        if status in TERMINAL:
            values["finished_at"] = _now()
        with writing(self.engine) as conn:
            done = conn.execute(update(JobRow).where(JobRow.id == job_id, JobRow.worker == worker,
                                                     JobRow.status == "running").values(**values))
            if done.rowcount != 1:
                raise LeaseLost(f"job {job_id} is no longer held by worker {worker}")
            if also is not None:
                conn.execute(also)
            self._event(conn, job_id, message, level="error" if status == "failed" else "info")

    def release(self, job_id: str, worker: str, message: str) -> None:
        """The worker stops without finishing (it was asked to stop): the job is queued again
        and the next claim resumes it; this does not count against max_attempts' lost leases."""
        with writing(self.engine) as conn:
            done = conn.execute(update(JobRow).where(JobRow.id == job_id, JobRow.worker == worker,
                                                     JobRow.status == "running")
                                .values(status="queued", worker=None, lease_until=None))
            if done.rowcount != 1:
                raise LeaseLost(f"job {job_id} is no longer held by worker {worker}")
            self._event(conn, job_id, message)

    # ------------------------------------------------------------------ events, checkpoints

    def add_event(self, job_id: str, message: str, *, level: str = "info", type: str = "message",
                  data: dict[str, Any] | None = None) -> None:
        with writing(self.engine) as conn:
            self._event(conn, job_id, message, level=level, type=type, data=data)

    def metric_steps(self, job_id: str) -> set[int]:
        """The steps the job's `metrics` events report (across its attempts)."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(EventRow.data).where(EventRow.job_id == job_id, EventRow.type == "metrics"))
            return {int(data["step"]) for (data,) in rows if data and "step" in data}

    def list_events(self, tenant: str, job_id: str, *, after: str | None = None,
                    limit: int = 20) -> tuple[list[dict[str, Any]], bool]:
        with self.engine.connect() as conn:
            self._job(conn, tenant, job_id)
            return _page(conn, EventRow, {"job_id": job_id}, after, limit, False)

    def add_checkpoint(self, job_id: str, step: int, metrics: dict[str, Any], name: str, path: str) -> dict[str, Any]:
        row = dict(id=new_id("ftckpt"), job_id=job_id, created_at=_now(), step=step, metrics=metrics,
                   fine_tuned_model_checkpoint=name, path=path)
        with writing(self.engine) as conn:
            conn.execute(insert(CheckpointRow).values(**row))
        return row

    def list_checkpoints(self, tenant: str, job_id: str, *, after: str | None = None,
                         limit: int = 10) -> tuple[list[dict[str, Any]], bool]:
        with self.engine.connect() as conn:
            self._job(conn, tenant, job_id)
            return _page(conn, CheckpointRow, {"job_id": job_id}, after, limit, False)

    def checkpoint_steps(self, job_id: str) -> set[int]:
        with self.engine.connect() as conn:
            return set(conn.scalars(select(CheckpointRow.step).where(CheckpointRow.job_id == job_id)))

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _job(conn, tenant: str | None, job_id: str) -> dict[str, Any]:
        row = conn.execute(_JOB if tenant is None else _OWNED_JOB, {"id": job_id, "tenant": tenant}).first()
        if row is None:
            raise NotFound(f"no fine-tuning job {job_id!r}", "fine_tuning_job_id")
        return _dict(row)

    def _event(self, conn, job_id: str, message: str, *, level: str = "info", type: str = "message",
               data: dict[str, Any] | None = None) -> None:
        conn.execute(insert(EventRow).values(id=new_id("ftevent"), job_id=job_id, created_at=_now(), level=level,
                                             type=type, message=message, data=data))



# The statements of the read paths the API serves most, built once: building a select and
# computing its cache key costs SQLAlchemy more than SQLite takes to run it.
_JOB = select(JobRow.__table__).where(JobRow.id == bindparam("id"))
_OWNED_JOB = _JOB.where(JobRow.tenant == bindparam("tenant"))
_PAGES: dict[tuple, tuple[Select, Select, Select]] = {}  # (table, equal columns, ascending) -> statements


def _page(conn, table, equal: dict[str, Any], after: str | None, limit: int,
          ascending: bool) -> tuple[list[dict[str, Any]], bool]:
    """Rows whose columns equal `equal`, in seq order (newest first unless `ascending`),
    starting after the row `after` (an id of this listing; an unknown one is a 404), and
    whether more follow."""
    key = (table, tuple(sorted(equal)), ascending)
    if key not in _PAGES:
        where = [getattr(table, name) == bindparam(name) for name in key[1]]
        cursor = bindparam("cursor")
        first = (select(table.__table__).where(*where).order_by(table.seq.asc() if ascending else table.seq.desc())
                 .limit(bindparam("limit")))
        _PAGES[key] = (select(table.seq).where(table.id == bindparam("after"), *where), first,
                       first.where(table.seq > cursor if ascending else table.seq < cursor))
    find_after, first_page, next_page = _PAGES[key]
    params = {**equal, "limit": max(1, min(limit, MAX_LIST * 10)) + 1}
    if after is not None:
        params["cursor"] = conn.scalar(find_after, {**equal, "after": after})
        if params["cursor"] is None:
            raise NotFound(f"after={after!r} is not an id of this listing", "after")
    rows = conn.execute(first_page if after is None else next_page, params).all()
    limit = params["limit"] - 1
    return [_dict(r) for r in rows[:limit]], len(rows) > limit


def data_file_url(data_dir: str | Path) -> str:
    """The default job database: SQLite in the data directory."""
    return f"sqlite:///{(Path(data_dir) / 'jobs.db').resolve()}"


def worker_name() -> str:
    """host:pid, what a job's `worker` field and events show."""
    return f"{os.uname().nodename}:{os.getpid()}"
