"""The fine-tuning service's core, below its HTTP routes (service/finetune_routes.py): uploads,
job creation with its checks, and the models a tenant may use. Knows nothing of HTTP: it
raises `OpenAIError`s, which the app answers in OpenAI's shape.

Creating a job checks, before anything is stored: the request's fields (jobs/requests.py),
that the model is a base model this server offers or a fine-tuned model of the tenant, and
that the files are the tenant's `fine-tune` files. The job row is then created in
`validating_files`, its rows are checked against the method's format (jobs/file_check.py) and
the job is queued with its "auto" hyperparameters resolved, or failed with an error naming
the bad lines. A worker (service/job_worker.py) takes it from the queue.
"""

from __future__ import annotations

import functools
import hashlib
import shutil
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy.exc import IntegrityError

from flywheel.jobs import JobRequest, JobStore, JobStoreError, RequestError
from flywheel.jobs.file_check import check_file, check_rows, count_rows
from flywheel.jobs.hyperparameters import resolve
from flywheel.jobs.limits import TenantLimits
from flywheel.jobs.objects import file_object, job_object
from flywheel.service.errors import OpenAIError

PURPOSES = ("fine-tune",)
RUNNABLE = ("supervised", "dpo", "reinforcement")  # methods a worker trains (service/job_worker.py)


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

    # ------------------------------------------------------------------ files

    def upload(self, tenant: str, filename: str, purpose: str, content: bytes,
               idempotency_key: str | None = None) -> dict[str, Any]:
        """A new file; with `idempotency_key`, a retry of the same upload gets the same file."""
        request_hash = hashlib.sha256(b"\0".join([filename.encode(), purpose.encode(), content])).hexdigest()
        if idempotency_key is not None:
            earlier = self._earlier("file", tenant, idempotency_key, request_hash)
            if earlier is not None:
                return file_object(earlier)
        try:
            return self._upload(tenant, filename, purpose, content, idempotency_key, request_hash)
        except IntegrityError:  # a concurrent retry with the same key stored it first
            return file_object(self._earlier("file", tenant, idempotency_key, request_hash))

    def _earlier(self, kind: str, tenant: str, key: str, request_hash: str) -> dict[str, Any] | None:
        try:
            return self.jobs.find(kind, tenant, key, request_hash)
        except JobStoreError as exc:
            raise store_error(exc) from None

    def _upload(self, tenant: str, filename: str, purpose: str, content: bytes, idempotency_key: str | None,
                request_hash: str) -> dict[str, Any]:
        if purpose not in PURPOSES:
            raise OpenAIError(f"purpose must be one of {', '.join(PURPOSES)} on this server, got {purpose!r}",
                              param="purpose")
        if len(content) > self.max_file_bytes:
            raise OpenAIError(f"file is {len(content)} bytes; the limit is {self.max_file_bytes}", param="file",
                              status=413)
        lines = jsonl_lines(content, filename)
        return file_object(self.jobs.add_file(tenant, filename, purpose, content, lines,
                                              idempotency_key=idempotency_key, request_hash=request_hash))

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
        self._validate(row["id"], tenant, req)
        return job_object(self.jobs.get_job(tenant, row["id"]))

    def _fine_tune_file(self, tenant: str, file_id: str, param: str) -> dict[str, Any]:
        try:
            f = self.jobs.get_file(tenant, file_id)
        except JobStoreError:
            raise OpenAIError(f"{param}: no file {file_id!r}", param=param, status=400, code="file_not_found") from None
        if f["purpose"] != "fine-tune":
            raise OpenAIError(f"{param}: file {file_id} has purpose {f['purpose']!r}, not 'fine-tune'", param=param)
        return f

    def _validate(self, job_id: str, tenant: str, req: JobRequest) -> None:
        """validating_files -> queued with resolved hyperparameters, or failed naming bad lines."""
        n_rows = 0
        for param in ("training_file", "validation_file"):
            file_id = getattr(req, param)
            if file_id is None:
                continue
            content = self.jobs.file_path(tenant, file_id).read_bytes()
            env_job = (req.grader or {}).get("type") == ENV_GRADER
            report = check_rows(content, environment_task_problem) if env_job else check_file(content, req.method_type)
            if not report.ok:
                error = {"code": f"invalid_{param}", "param": param,
                         "message": report.message(f"{param} {file_id} ({req.method_type} format)")}
                self.jobs.set_validated(job_id, error=error, hyperparameters=None)
                return
            if param == "training_file":
                n_rows = report.rows
        resolved = resolve(req.method_type, req.hyperparameters, n_rows)
        tokens = resolved["n_epochs"] * self._tokens(tenant, req)
        if tokens > self.limits.max_job_tokens:
            error = {"code": "too_many_tokens", "param": "training_file",
                     "message": f"the job would train on {tokens:,} tokens ({resolved['n_epochs']} epochs of the "
                                f"training file); this tenant's limit is {self.limits.max_job_tokens:,}"}
            self.jobs.set_validated(job_id, error=error, hyperparameters=None)
            return
        self.jobs.set_validated(job_id, error=None, hyperparameters=resolved, method=req.method(resolved))

    def _tokens(self, tenant: str, req: JobRequest) -> int:
        """Tokens of the training file's message texts under the base model's tokenizer."""
        tokenizer = _tokenizer(str(self.model_path(tenant, req.model)))
        total = 0
        for line in self.jobs.file_path(tenant, req.training_file).read_bytes().splitlines():
            if line.strip():
                total += len(tokenizer.encode(_texts(orjson.loads(line)), add_special_tokens=False))
        return total

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


def jsonl_lines(content: bytes, filename: str) -> int:
    """The number of JSON-object lines of an upload; a 400 naming the first line that is not one."""
    try:
        content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise OpenAIError(f"file {filename!r} is not UTF-8 text (byte {exc.start})", param="file") from None
    for number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = orjson.loads(line)
        except orjson.JSONDecodeError:
            raise OpenAIError(f"file {filename!r} is not JSONL: line {number} is not valid JSON", param="file") from None
        if not isinstance(value, dict):
            raise OpenAIError(f"file {filename!r} is not JSONL of objects: line {number} is a "
                              f"{type(value).__name__}", param="file")
    lines = count_rows(content)
    if lines == 0:
        raise OpenAIError(f"file {filename!r} has no rows", param="file")
    return lines


ENV_GRADER = "flywheel_environment"  # flywheel's extension: {"type", "env", "settings"}, rows are its tasks


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


def environment_task_problem(row: dict[str, Any]) -> str | None:
    """What is wrong with a row of an environment job (`{"task": {Task fields}}`), or None."""
    from flywheel.envs.replay import task_from_dict

    if not isinstance(row.get("task"), dict):
        return 'a row must be {"task": {prompt, answer, ...}}'
    try:
        task_from_dict(row["task"], default_id="row")
    except ValueError as e:
        return f"task: {e}"
    return None


def run_checked(grader, model_sample: str, item: dict[str, Any]) -> dict[str, Any]:
    """A checked grader's answer for one sample; a 400 when it cannot grade it."""
    from flywheel.envs.graders import GraderError, sample_of

    try:
        return grader.run(sample_of(model_sample), item)
    except GraderError as e:
        raise OpenAIError(str(e), param=e.param) from None


@functools.lru_cache(maxsize=8)
def _tokenizer(path: str):
    from flywheel.models import load_tokenizer

    return load_tokenizer(path)


def _texts(row: Any) -> str:
    """Every string in a row (message contents, tool calls, DPO outputs), joined: what a job trains on."""
    if isinstance(row, str):
        return row
    if isinstance(row, dict):
        return "\n".join(_texts(v) for v in row.values())
    if isinstance(row, list):
        return "\n".join(_texts(v) for v in row)
    return ""
