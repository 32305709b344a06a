"""The rows of managed flywheels and their cycles (jobs/tables.py FlywheelRow, FlywheelCycleRow).

A cycle is queued as a fine-tuning job (method `{"type": "flywheel", "flywheel":
{"flywheel_id", "cycle"}}`, no training file: it curates its own) together with its cycle row,
in one transaction, and only while the flywheel has no unfinished cycle, so two servers
polling the same trigger start it once. Production changes (`set_production`) bump the
flywheel's `generation`, which is what servers watch to switch the alias.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, insert, select, update

from flywheel.database import writing
from flywheel.jobs.flywheel_request import FlywheelSpec
from flywheel.jobs.store import ACTIVE, NotFound, _dict, _now, _page, new_id
from flywheel.jobs.tables import EventRow, FlywheelCycleRow, FlywheelRow, JobRow

CYCLE_METHOD = "flywheel"  # the method type of a cycle's job


class Flywheels:
    def __init__(self, engine):
        self.engine = engine

    # ---- flywheels

    def create(self, tenant: str, **fields: Any) -> dict[str, Any]:
        """A flywheel row (fields: FlywheelRow's columns, `id` among them or a new one; `metadata`
        for meta); returns it."""
        meta = fields.pop("metadata", None)
        row = dict(id=fields.pop("id", None) or new_id("fw"), tenant=tenant, status="active", generation=0,
                   created_at=_now(), meta=meta, **fields)
        with writing(self.engine) as conn:
            conn.execute(insert(FlywheelRow).values(**row))
        return self.get(tenant, row["id"])

    def get(self, tenant: str | None, flywheel_id: str) -> dict[str, Any]:
        """The flywheel (tenant None: whoever owns it, for workers and pollers); NotFound otherwise."""
        where = [FlywheelRow.id == flywheel_id] + ([] if tenant is None else [FlywheelRow.tenant == tenant])
        with self.engine.connect() as conn:
            row = conn.execute(select(FlywheelRow.__table__).where(*where)).first()
        if row is None:
            raise NotFound(f"no flywheel {flywheel_id!r}", "flywheel_id")
        return _dict(row)

    def find_alias(self, tenant: str, alias: str) -> dict[str, Any] | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(FlywheelRow.__table__).where(FlywheelRow.alias == alias,
                                                                   FlywheelRow.tenant == tenant)).first()
        return None if row is None else _dict(row)

    def count(self, tenant: str) -> int:
        with self.engine.connect() as conn:
            return conn.scalar(select(func.count()).select_from(FlywheelRow).where(FlywheelRow.tenant == tenant))

    def list(self, tenant: str, *, after: str | None = None, limit: int = 20) -> tuple[list[dict[str, Any]], bool]:
        with self.engine.connect() as conn:
            return _page(conn, FlywheelRow, {"tenant": tenant}, after, limit, False)

    def active(self) -> list[dict[str, Any]]:
        """Every tenant's active flywheels (what the trigger and the alias table read)."""
        with self.engine.connect() as conn:
            return [_dict(r) for r in conn.execute(select(FlywheelRow.__table__).where(FlywheelRow.status == "active")
                                                   .order_by(FlywheelRow.seq))]

    def aliases(self) -> dict[tuple[str, str], tuple[str, int]]:
        """(tenant, alias) -> (the model name it serves now, generation), for every flywheel."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(FlywheelRow.tenant, FlywheelRow.alias, FlywheelRow.production_model,
                                       FlywheelRow.generation)).all()
        return {(r.tenant, r.alias): (r.production_model, r.generation) for r in rows}

    def set_production(self, flywheel_id: str, model: str, version: str, cursor: int) -> dict[str, Any]:
        """Serve `model` (registry `version`) under the alias from now on; new failures count
        after trace `cursor`."""
        with writing(self.engine) as conn:
            conn.execute(production_update(flywheel_id, model, version, cursor))
        return self.get(None, flywheel_id)

    def set_status(self, flywheel_id: str, status: str) -> None:
        """"active" (its trigger starts cycles) or "paused" (only a cycle asked for by hand runs)."""
        with writing(self.engine) as conn:
            conn.execute(update(FlywheelRow).where(FlywheelRow.id == flywheel_id).values(status=status))

    def failed_in_a_row(self, flywheel_id: str) -> int:
        """How many of the flywheel's latest cycles failed, counting back to one that did not."""
        with self.engine.connect() as conn:
            statuses = conn.scalars(select(JobRow.status).join(FlywheelCycleRow, FlywheelCycleRow.job_id == JobRow.id)
                                    .where(FlywheelCycleRow.flywheel_id == flywheel_id)
                                    .order_by(FlywheelCycleRow.number.desc())).all()
        return next((i for i, s in enumerate(statuses) if s != "failed"), len(statuses))

    def set_cursor(self, flywheel_id: str, cursor: int) -> None:
        with writing(self.engine) as conn:
            conn.execute(update(FlywheelRow).where(FlywheelRow.id == flywheel_id).values(cursor=cursor))

    # ---- cycles

    def queue_cycle(self, flywheel_id: str, reason: str) -> dict[str, Any] | None:
        """Queue the flywheel's next cycle as a job; its cycle row, or None while a cycle is
        unfinished (its job not in a terminal state)."""
        with writing(self.engine) as conn:
            fw = conn.execute(select(FlywheelRow.__table__).where(FlywheelRow.id == flywheel_id)
                              .with_for_update()).first()  # PostgreSQL: one queuer at a time per flywheel
            if fw is None:
                raise NotFound(f"no flywheel {flywheel_id!r}", "flywheel_id")
            last = conn.execute(select(FlywheelCycleRow.number, JobRow.status)
                                .join(JobRow, JobRow.id == FlywheelCycleRow.job_id)
                                .where(FlywheelCycleRow.flywheel_id == flywheel_id)
                                .order_by(FlywheelCycleRow.number.desc()).limit(1)).first()
            if last is not None and last.status in ACTIVE:
                return None
            number = 1 if last is None else last.number + 1
            now = _now()
            job_id = new_id("ftjob")
            conn.execute(insert(JobRow).values(
                id=job_id, tenant=fw.tenant, model=fw.model, training_file=None, validation_file=None,
                suffix=fw.suffix, seed=number, meta={"flywheel_id": flywheel_id, "cycle": str(number)},
                status="queued", created_at=now, attempts=0,
                method={"type": CYCLE_METHOD, CYCLE_METHOD: {"flywheel_id": flywheel_id, "cycle": number,
                                                             "reason": reason}}))
            conn.execute(insert(EventRow).values(
                id=new_id("ftevent"), job_id=job_id, created_at=now, level="info", type="message",
                message=f"Flywheel {flywheel_id} cycle {number} queued: {reason}", data=None))
            cycle_id = new_id("fwcycle")
            conn.execute(insert(FlywheelCycleRow).values(id=cycle_id, flywheel_id=flywheel_id, number=number,
                                                         job_id=job_id, reason=reason, created_at=now))
        return self.cycle(None, cycle_id)

    def cycle(self, tenant: str | None, cycle_id: str) -> dict[str, Any]:
        with self.engine.connect() as conn:
            row = conn.execute(_CYCLES.where(FlywheelCycleRow.id == cycle_id,
                                             *([] if tenant is None else [FlywheelRow.tenant == tenant]))).first()
        if row is None:
            raise NotFound(f"no flywheel cycle {cycle_id!r}", "cycle_id")
        return _dict(row)

    def cycle_of_job(self, job_id: str) -> dict[str, Any] | None:
        with self.engine.connect() as conn:
            row = conn.execute(_CYCLES.where(FlywheelCycleRow.job_id == job_id)).first()
        return None if row is None else _dict(row)

    def cycles(self, tenant: str, flywheel_id: str) -> list[dict[str, Any]]:
        """The flywheel's cycles, newest first, each with its job's status, model and cost."""
        self.get(tenant, flywheel_id)  # NotFound for another tenant's
        with self.engine.connect() as conn:
            rows = conn.execute(_CYCLES.where(FlywheelCycleRow.flywheel_id == flywheel_id)
                                .order_by(FlywheelCycleRow.number.desc())).all()
        return [_dict(r) for r in rows]

    def record_cycle(self, cycle_id: str, **fields: Any) -> None:
        """What a cycle decided (FlywheelCycleRow's columns: outcome, decision, scores, ...)."""
        with writing(self.engine) as conn:
            conn.execute(update(FlywheelCycleRow).where(FlywheelCycleRow.id == cycle_id).values(**fields))

    def model_of_version(self, flywheel_id: str, version: str) -> str | None:
        """The servable model name of a registry version of the flywheel: the model it started
        from (its first version), or the fine-tuned model of the cycle that registered it."""
        fw = self.get(None, flywheel_id)
        if version == FlywheelSpec.model_validate(fw["spec"]).initial_version:
            return fw["model"]
        with self.engine.connect() as conn:
            return conn.scalar(select(JobRow.fine_tuned_model)
                               .join(FlywheelCycleRow, FlywheelCycleRow.job_id == JobRow.id).where(FlywheelCycleRow.flywheel_id == flywheel_id, FlywheelCycleRow.version == version))


def production_update(flywheel_id: str, model: str, version: str, cursor: int):
    """The statement that points the flywheel's alias at `model` (registry `version`)."""
    return update(FlywheelRow).where(FlywheelRow.id == flywheel_id).values(
        production_model=model, production_version=version, cursor=cursor, generation=FlywheelRow.generation + 1)


_CYCLES = (select(FlywheelCycleRow.__table__, JobRow.status.label("job_status"),
                  JobRow.fine_tuned_model.label("fine_tuned_model"), JobRow.estimated_cost.label("estimated_cost"),
                  JobRow.error.label("job_error"), FlywheelRow.tenant.label("tenant"))
           .join(JobRow, JobRow.id == FlywheelCycleRow.job_id)
           .join(FlywheelRow, FlywheelRow.id == FlywheelCycleRow.flywheel_id))
