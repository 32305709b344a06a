"""Managed flywheels (flywheel's extension of the fine-tuning API): a tenant's continuous loop
for one of its models, run by the service.

- `create`: a checked request (jobs/flywheel_request.py) for a model the tenant can serve.
  The flywheel gets a folder of its own (registry, cycles, ledger) under the data directory,
  with the model as its first, production version, and a production alias,
  `ft:<model>:<tenant>:<suffix>:production`, that the tenant's clients call. Traffic to the
  alias, and traces posted naming it (or the request's `traces.models`), feed the flywheel.
- Cycles: the trigger (finetuning/flywheel_trigger.py) or `run_cycle` queues one as a
  fine-tuning job (jobs/flywheels.py) that a `flywheel worker` runs: loop/cycle.py's cycle on
  the flywheel's own traces, gated against its production version. A promotion names the
  job's fine-tuned model and points the alias at it; servers switch (serve/aliases.py)
  after loading it, so no request fails over the switch.
- `rollback`: production back to the version promoted before (or `to`), one call; a cycle
  running meanwhile is rejected at its end ("production changed during the cycle").
The single-tenant daemon (`flywheel loop run`) is the same cycle over one data directory.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

import orjson

from sqlalchemy.exc import IntegrityError

from flywheel.config import ConfigError
from flywheel.jobs.flywheel_request import FlywheelRequest
from flywheel.jobs.flywheels import Flywheels
from flywheel.jobs.objects import flywheel_cycle_object, flywheel_object, production_alias
from flywheel.jobs.requests import RequestError
from flywheel.jobs.store import JobStoreError, new_id
from flywheel.loop.loop_config import check_stages
from flywheel.finetuning.managed_config import managed_config
from flywheel.registry.registry import Registry
from flywheel.registry.storage import RegistryError
from flywheel.errors import OpenAIError
from flywheel.finetuning.fine_tuning import ENV_GRADER, FineTuning, check_grader, store_error


MAX_FLYWHEELS = 16  # per tenant


class ManagedFlywheels:
    def __init__(self, fine_tuning: FineTuning, trace_store):
        """trace_store: the server's trace store (its URL is where the flywheels' traces are)."""
        self.fine_tuning = fine_tuning
        self.store = Flywheels(fine_tuning.jobs.engine)
        self.traces = trace_store
        self.root = Path(fine_tuning.jobs.files_dir).resolve().parent / "flywheels"

    def create(self, tenant: str, body: Any, idempotency_key: str | None = None) -> dict[str, Any]:
        request_hash = hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()
        try:
            if idempotency_key is not None:
                earlier = self.fine_tuning.jobs.find("flywheel", tenant, idempotency_key, request_hash)
                if earlier is not None:
                    return flywheel_object(earlier)
            req = FlywheelRequest.parse(body)
        except (JobStoreError, RequestError) as exc:
            raise store_error(exc) from None
        path = self.fine_tuning.servable_path(tenant, req.model)
        if path is None:
            raise OpenAIError(f"model: unknown model {req.model!r}", param="model", status=404,
                              type="not_found_error", code="model_not_found")
        suites = self._graded_suites(tenant, req)
        if self.store.count(tenant) >= MAX_FLYWHEELS:
            raise OpenAIError(f"a tenant may have {MAX_FLYWHEELS} flywheels, and this one has that many",
                              status=429, code="rate_limit_exceeded")
        alias = production_alias(req.model, tenant, req.suffix)
        if self.store.find_alias(tenant, alias) is not None:
            raise OpenAIError(f"suffix: a flywheel of {req.model!r} already serves {alias!r}; choose another suffix",
                              param="suffix", status=409, code="conflict")
        spec = req.spec()
        for name, file_path in suites.items():
            spec.eval.suites[name].path = file_path
        try:  # what its cycles will run, checked now: a flywheel that could not cycle is refused, never made
            check_stages(managed_config(spec, data_dir=str(self.root), traces_url="sqlite://", hardware="cpu-2core"))
        except ConfigError as exc:
            raise OpenAIError(f"the flywheel's loop config is invalid: {str(exc).splitlines()[-1].strip()}") from None
        flywheel_id = new_id("fw")
        data_dir = self.root / flywheel_id
        registry = Registry(data_dir / "registry")
        try:
            first = registry.register(path, link=True, notes=f"the model flywheel {flywheel_id} started from")
            registry.promote(first.id, reason="the flywheel's starting model")
        except RegistryError as exc:
            raise OpenAIError(f"model {req.model!r} cannot start a flywheel: {exc}", param="model") from None
        finally:
            registry.close()
        spec.initial_version = first.id
        spec.trace_models = list(dict.fromkeys([alias, *req.traces.models]))
        try:
            row = self.store.create(tenant, id=flywheel_id, model=req.model, suffix=req.suffix, alias=alias, spec=spec.model_dump(mode="json"),
                                    data_dir=str(data_dir), production_model=req.model,
                                    traces_url=self.traces.engine.url.render_as_string(hide_password=False),
                                    production_version=first.id, cursor=0, metadata=req.metadata or None,
                                    idempotency_key=idempotency_key, request_hash=request_hash)
        except IntegrityError:  # a concurrent request made it first (the same key, or the same alias)
            shutil.rmtree(data_dir, ignore_errors=True)
            earlier = idempotency_key and self.fine_tuning.jobs.find("flywheel", tenant, idempotency_key, request_hash)
            if earlier:
                return flywheel_object(earlier)
            raise OpenAIError(f"suffix: a flywheel of {req.model!r} already serves {alias!r}", param="suffix",
                              status=409, code="conflict") from None
        return flywheel_object(row)

    def _graded_suites(self, tenant: str, req: FlywheelRequest) -> dict[str, str]:
        """Suite name -> the folder path of its file, for the suites of a file and grader: the
        file must be the tenant's, the grader valid (score_model graders are not offered here)."""
        paths = {}
        for name, suite in req.eval.suites.items():
            if suite.file is None:
                continue
            where = f"eval.suites.{name}"
            if suite.grader.get("type") in ("score_model", ENV_GRADER):
                raise OpenAIError(f"{where}.grader: a {suite.grader['type']} grader cannot score a flywheel's "
                                  "suite; use string_check, text_similarity, python or multi", param=f"{where}.grader")
            check_grader(suite.grader, where=f"{where}.grader")
            try:
                self.fine_tuning.jobs.get_file(tenant, suite.file)
                paths[name] = str(self.fine_tuning.jobs.file_path(tenant, suite.file))
            except JobStoreError:
                raise OpenAIError(f"{where}.file: no file {suite.file!r}", param=f"{where}.file", status=404,
                                  type="not_found_error") from None
        return paths

    def get(self, tenant: str, flywheel_id: str) -> dict[str, Any]:
        return flywheel_object(self._row(tenant, flywheel_id))

    def list(self, tenant: str, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        try:
            rows, more = self.store.list(tenant, after=after, limit=limit)
        except JobStoreError as exc:
            raise store_error(exc) from None
        return [flywheel_object(r) for r in rows], more

    def cycles(self, tenant: str, flywheel_id: str) -> list[dict[str, Any]]:
        try:
            return [flywheel_cycle_object(r) for r in self.store.cycles(tenant, flywheel_id)]
        except JobStoreError as exc:
            raise store_error(exc) from None

    def run_cycle(self, tenant: str, flywheel_id: str) -> dict[str, Any]:
        """Queue a cycle now (whatever the trigger says; a paused flywheel is active again);
        a 409 while one is unfinished."""
        self._row(tenant, flywheel_id)
        try:
            cycle = self.store.queue_cycle(flywheel_id, "requested through the API")
        except IntegrityError:  # another server queued this number at the same moment
            cycle = None
        if cycle is not None:
            self.store.set_status(flywheel_id, "active")
        if cycle is None:
            raise OpenAIError(f"flywheel {flywheel_id} has a cycle that has not finished", param="flywheel_id",
                              status=409, code="conflict")
        return flywheel_cycle_object(cycle)

    def rollback(self, tenant: str, flywheel_id: str, to: str | None = None,
                 idempotency_key: str | None = None) -> dict[str, Any]:
        """Production back to the version promoted before the current one (or `to`, a
        version the flywheel has promoted); the alias follows within a poll. A retry with the
        same `idempotency_key` after the rollback committed rolls back nothing more."""
        row = self._row(tenant, flywheel_id)
        registry = Registry(Path(row["data_dir"]) / "registry")
        reason = "rollback requested through the API" + (f" (request {idempotency_key})" if idempotency_key else "")
        try:
            done = [e for e in registry.history() if e.action == "rollback" and e.reason == reason]
            if idempotency_key and done:
                target = registry.get(done[-1].version)
                if row["production_version"] == target.id:
                    return flywheel_object(row)
            else:
                target = registry.rollback(to=to, reason=reason)
        except RegistryError as exc:
            raise OpenAIError(f"rollback: {exc}", param="to" if to else None, status=409, code="conflict") from None
        finally:
            registry.close()
        model = self.store.model_of_version(flywheel_id, target.id)
        if model is None:
            raise OpenAIError(f"rollback: version {target.id} has no servable model", param="to", status=409)
        return flywheel_object(self.store.set_production(flywheel_id, model, target.id, self.traces.max_seq()))

    def _row(self, tenant: str, flywheel_id: str) -> dict[str, Any]:
        try:
            return self.store.get(tenant, flywheel_id)
        except JobStoreError as exc:
            raise store_error(exc) from None
