"""The fine-tuning service's core, below its HTTP routes (serve/finetune_routes.py): uploads,
job creation with its checks, and the models a tenant may use. Knows nothing of HTTP: it
raises `OpenAIError`s, which the app answers in OpenAI's shape.

An upload is streamed to disk and checked a line at a time as it goes (jobs/upload.py): JSON
objects in UTF-8, each line at most `max_line_bytes`, whatever the file's size.

Creating a job checks, before anything is stored: the request's fields (jobs/requests.py),
that the model is a base model this server offers or a fine-tuned model of the tenant, and
that the files are the tenant's `fine-tune` files. The job row is then created in
`validating_files` and the call returns; its rows are checked against the method's format
and its tokens counted in a process of their own (finetuning/job_validation.py), and the job is
queued with its "auto" hyperparameters resolved, or failed with an error naming the bad
lines. A worker (worker/job_worker.py) takes it from the queue.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any, BinaryIO

import orjson
from sqlalchemy.exc import IntegrityError

from flywheel.jobs import JobRequest, JobStore, JobStoreError, RequestError
from flywheel.jobs.limits import TenantLimits
from flywheel.jobs.objects import file_object, job_object
from flywheel.jobs.upload import StagedUpload, UploadError
from flywheel.errors import OpenAIError
from flywheel.finetuning.job_validation import ENV_GRADER, JobValidator

PURPOSES = ("fine-tune",)
RUNNABLE = ("supervised", "dpo", "reinforcement")  # methods a worker trains (worker/job_worker.py)


def store_error(exc: JobStoreError | RequestError) -> OpenAIError:
    """A store or request refusal as the API answers it."""
    if isinstance(exc, RequestError):
        return OpenAIError(str(exc), param=exc.param)
    kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
    return OpenAIError(str(exc), param=exc.param, status=exc.status, type=kind, code=exc.code)


class FineTuning:
    def __init__(self, jobs: JobStore, base_models: dict[str, str | Path], *, limits: TenantLimits = TenantLimits()):
        """base_models: name -> local model folder, what jobs may start from; limits: per tenant."""
        self.jobs = jobs
        self.base_models = {name: Path(p) for name, p in base_models.items()}
        self.limits = limits
        self.max_file_bytes = limits.max_file_bytes
        self.validator = JobValidator(jobs, limits, self.model_path)

    def start(self) -> None:
        """Start the file checker, and check the files of jobs a stopped server left in
        `validating_files`."""
        self.validator.start()
        self.validator.resume()

    def close(self) -> None:
        """Stop checking files (a job being checked is checked again by the next `start`)."""
        self.validator.close()

    # ------------------------------------------------------------------ files

    def upload(self, tenant: str, filename: str, purpose: str, source: BinaryIO,
               idempotency_key: str | None = None) -> dict[str, Any]:
        """A new file from the binary stream `source`; with `idempotency_key`, a retry of the
        same upload gets the same file."""
        if purpose not in PURPOSES:
            raise OpenAIError(f"purpose must be one of {', '.join(PURPOSES)} on this server, got {purpose!r}",
                              param="purpose")
        try:
            staged = self.jobs.stage(source, filename, purpose, max_bytes=self.max_file_bytes,
                                     max_line_bytes=self.limits.max_line_bytes)
        except UploadError as exc:
            raise OpenAIError(str(exc), param="file", status=413 if exc.too_large else 400) from None
        try:
            if idempotency_key is not None:
                earlier = self._earlier("file", tenant, idempotency_key, staged.request_hash)
                if earlier is not None:
                    return file_object(earlier)
            return self._add_file(tenant, filename, purpose, staged, idempotency_key)
        finally:
            staged.path.unlink(missing_ok=True)  # gone already unless it was not stored

    def _add_file(self, tenant: str, filename: str, purpose: str, staged: StagedUpload,
                  idempotency_key: str | None) -> dict[str, Any]:
        try:
            return file_object(self.jobs.add_file(tenant, filename, purpose, staged, idempotency_key=idempotency_key))
        except IntegrityError:  # a concurrent retry with the same key stored it first
            return file_object(self._earlier("file", tenant, idempotency_key, staged.request_hash))

    def _earlier(self, kind: str, tenant: str, key: str, request_hash: str) -> dict[str, Any] | None:
        try:
            return self.jobs.find(kind, tenant, key, request_hash)
        except JobStoreError as exc:
            raise store_error(exc) from None

    # ------------------------------------------------------------------ jobs

    def create_job(self, tenant: str, body: Any, idempotency_key: str | None = None) -> dict[str, Any]:
        """A new job (validated, then queued or failed); with `idempotency_key`, a retry of the
        same request gets the same job."""
        request_hash = hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()
        if idempotency_key is not None:
            earlier = self._earlier("job", tenant, idempotency_key, request_hash)
            if earlier is not None:
                return job_object(earlier)
        try:
            return self._create_job(tenant, body, idempotency_key, request_hash)
        except IntegrityError:
            return job_object(self._earlier("job", tenant, idempotency_key, request_hash))

    def _create_job(self, tenant: str, body: Any, idempotency_key: str | None, request_hash: str) -> dict[str, Any]:
        try:
            req = JobRequest.parse(body)
            if req.method_type not in RUNNABLE:
                raise OpenAIError(f"method.type: {req.method_type} jobs are not run by this server yet "
                                  f"(runnable: {', '.join(RUNNABLE)})", param="method.type")
            self.model_path(tenant, req.model)
            if self.jobs.unfinished(tenant) >= self.limits.max_unfinished:
                raise OpenAIError(f"this tenant has {self.limits.max_unfinished} unfinished jobs, its limit: cancel "
                                  "one or wait for one to finish", status=429, type="rate_limit_error",
                                  code="quota_exceeded")
            if req.grader is not None:
                check_grader(req.grader, models=self.grader_models(tenant, req.grader))
            for param in ("training_file", "validation_file"):
                file_id = getattr(req, param)
                if file_id is not None:
                    self._fine_tune_file(tenant, file_id, param)
            row = self.jobs.create_job(tenant, model=req.model, method=req.method(), training_file=req.training_file,
                                       validation_file=req.validation_file, suffix=req.suffix,
                                       seed=req.seed if req.seed is not None else 42, meta=req.metadata or None,
                                       idempotency_key=idempotency_key, request_hash=request_hash)
        except (JobStoreError, RequestError) as exc:
            raise store_error(exc) from None
        self.validator.submit(row["id"], tenant, req)
        return job_object(self.jobs.get_job(tenant, row["id"]))

    def _fine_tune_file(self, tenant: str, file_id: str, param: str) -> dict[str, Any]:
        try:
            f = self.jobs.get_file(tenant, file_id)
        except JobStoreError:
            raise OpenAIError(f"{param}: no file {file_id!r}", param=param, status=400, code="file_not_found") from None
        if f["purpose"] != "fine-tune":
            raise OpenAIError(f"{param}: file {file_id} has purpose {f['purpose']!r}, not 'fine-tune'", param=param)
        return f

    # ------------------------------------------------------------------ models

    def model_path(self, tenant: str, name: str) -> Path:
        """The folder of base model `name`, or of the tenant's fine-tuned model `name`."""
        path = self.servable_path(tenant, name)
        if path is None:
            offered = ", ".join(sorted(self.base_models)) or "none"
            raise OpenAIError(f"model: unknown model {name!r} (base models here: {offered}; or one of your "
                              "fine-tuned models)", param="model", code="model_not_found")
        return path

    def grader_models(self, tenant: str, grader: Any) -> dict[str, str]:
        """Folders of the models a grader's score_model graders name (base or the tenant's own);
        a 400 naming an unknown one."""
        out = {}
        for name in sorted(score_model_names(grader)):
            path = self.servable_path(tenant, name)
            if path is None:
                raise OpenAIError(f"method.reinforcement.grader: score_model names model {name!r}, which is "
                                  "neither a base model here nor one of your fine-tuned models",
                                  param="method.reinforcement.grader.model", code="model_not_found")
            out[name] = str(path)
        return out

    def servable_path(self, tenant: str, name: str) -> Path | None:
        """model_path, or None for a name that is neither (how the server finds a model to serve)."""
        if name in self.base_models:
            return self.base_models[name]
        path = self.jobs.fine_tuned_model_path(tenant, name)
        return None if path is None else Path(path)

    def delete_model(self, tenant: str, name: str) -> Path:
        """Delete the tenant's fine-tuned model `name` (not a base model, not another's); its
        folder is removed and its checkpoints stay. Returns the folder it was in."""
        if name in self.base_models:
            raise OpenAIError(f"model: {name!r} is a base model; only fine-tuned models can be deleted",
                              param="model", status=403, type="permission_error")
        try:
            path = Path(self.jobs.delete_model(tenant, name))
        except JobStoreError as exc:
            raise store_error(exc) from None
        shutil.rmtree(path, ignore_errors=True)
        return path

    def models(self, tenant: str) -> list[dict[str, Any]]:
        """Base models and the tenant's fine-tuned models, as OpenAI lists models."""
        cards = [{"id": name, "object": "model", "created": 0, "owned_by": "flywheel"} for name in self.base_models]
        for job in self.jobs.fine_tuned_models(tenant):
            cards.append({"id": job["fine_tuned_model"], "object": "model",
                          "created": job_object(job)["finished_at"], "owned_by": tenant})
        return cards


def score_model_names(spec: Any) -> set[str]:
    """The models a grader's score_model graders (at any depth of a multi) ask."""
    if not isinstance(spec, dict):
        return set()
    names = {spec["model"]} if spec.get("type") == "score_model" and isinstance(spec.get("model"), str) else set()
    for sub in (spec.get("graders") or {}).values() if isinstance(spec.get("graders"), dict) else ():
        names |= score_model_names(sub)
    return names


def check_grader(spec: Any, where: str = "method.reinforcement.grader", models: dict[str, str] | None = None):
    """The checked Grader (None for a flywheel environment, which loads), or a 400 naming the
    field of an invalid one. models: score_model names -> folders (a grader naming a model
    not in it is refused)."""
    from flywheel.envs.graders import GraderError, LocalScorer, build_grader

    if isinstance(spec, dict) and spec.get("type") == ENV_GRADER:
        check_environment(spec, where)
        return None
    try:
        return build_grader(spec, where=where, score_model=LocalScorer(models) if models else None)
    except GraderError as e:
        raise OpenAIError(str(e), param=e.param) from None


def check_environment(spec: dict[str, Any], where: str) -> None:
    from flywheel.envs import load_env

    extra = sorted(set(spec) - {"type", "name", "env", "settings"})
    if extra:
        raise OpenAIError(f"{where}.{extra[0]}: not a field of a {ENV_GRADER} grader (type, name, env, settings)",
                          param=f"{where}.{extra[0]}")
    if not isinstance(spec.get("env"), str) or not isinstance(spec.get("settings", {}), dict):
        raise OpenAIError(f"{where}.env must name an environment (built-in or package.module:load), settings an "
                          "object", param=f"{where}.env")
    try:
        load_env(spec["env"], **spec.get("settings", {}))
    except Exception as e:  # noqa: BLE001 - whatever the loader raised, as a 400 naming the field
        raise OpenAIError(f"{where}.env: {spec['env']!r} does not load: {type(e).__name__}: {e}",
                          param=f"{where}.env") from None


def run_checked(grader, model_sample: str, item: dict[str, Any]) -> dict[str, Any]:
    """A checked grader's answer for one sample; a 400 when it cannot grade it."""
    from flywheel.envs.graders import GraderError, sample_of

    try:
        return grader.run(sample_of(model_sample), item)
    except GraderError as e:
        raise OpenAIError(str(e), param=e.param) from None
