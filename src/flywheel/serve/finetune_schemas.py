"""The fine-tuning routes' objects as pydantic models, for the OpenAPI document only (the routes
build their answers in jobs/objects.py and parse job requests in jobs/requests.py; tests check
that the two agree: every answer validates against its model here)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Status = Literal["validating_files", "queued", "running", "paused", "succeeded", "failed", "cancelled"]
Auto = Literal["auto"]


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FileObject(_Out):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"]
    status_details: None
    expires_at: None


class FileList(_Out):
    object: Literal["list"]
    data: list[FileObject]
    has_more: bool
    first_id: str | None
    last_id: str | None


class FileDeleted(_Out):
    id: str
    object: Literal["file"]
    deleted: bool


class JobError(_Out):
    code: str
    message: str = Field(description="what went wrong; for a bad file, the line numbers of its bad rows and why")
    param: str | None


class Usage(_Out):
    trained_tokens: int | None
    estimated_cost: float | None = Field(description="US dollars at the catalog price of the workers' hardware")
    attempts: int = Field(description="how many times a worker took the job up")


class FineTuningJob(_Out):
    id: str
    object: Literal["fine_tuning.job"]
    model: str
    created_at: int
    finished_at: int | None
    fine_tuned_model: str | None
    organization_id: str = Field(description="the tenant that owns the job")
    result_files: list[str]
    status: Status
    training_file: str | None = Field(description="null for a managed flywheel's cycle: it curates its own data")
    validation_file: str | None
    hyperparameters: dict[str, Any] = Field(description="as resolved: 'auto' replaced by the value used")
    trained_tokens: int | None
    error: JobError | None
    user_provided_suffix: str | None
    seed: int
    estimated_finish: int | None
    integrations: list[Any]
    metadata: dict[str, str] | None
    method: dict[str, Any]
    usage: Usage


class JobList(_Out):
    object: Literal["list"]
    data: list[FineTuningJob]
    has_more: bool
    first_id: str | None
    last_id: str | None


class JobEvent(_Out):
    id: str
    object: Literal["fine_tuning.job.event"]
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    data: dict[str, Any]
    type: Literal["message", "metrics"]


class JobEventList(_Out):
    object: Literal["list"]
    data: list[JobEvent]
    has_more: bool
    first_id: str | None
    last_id: str | None


class JobCheckpoint(_Out):
    id: str
    object: Literal["fine_tuning.job.checkpoint"]
    created_at: int
    fine_tuned_model_checkpoint: str = Field(description="a model name usable in /v1/chat/completions at once")
    fine_tuning_job_id: str
    metrics: dict[str, Any]
    step_number: int


class JobCheckpointList(_Out):
    object: Literal["list"]
    data: list[JobCheckpoint]
    has_more: bool
    first_id: str | None
    last_id: str | None


class Hyperparameters(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n_epochs: Auto | int | None = None
    batch_size: Auto | int | None = None
    learning_rate_multiplier: Auto | float | None = None


class DpoHyperparameters(Hyperparameters):
    beta: Auto | float | None = None


class MethodSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hyperparameters: Hyperparameters | None = None


class DpoSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hyperparameters: DpoHyperparameters | None = None


class ReinforcementHyperparameters(Hyperparameters):
    eval_interval: Auto | int | None = None
    eval_samples: Auto | int | None = None
    compute_multiplier: Auto | float | None = None
    reasoning_effort: Literal["auto", "default", "low", "medium", "high"] | None = None


class ReinforcementSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grader: dict[str, Any] = Field(description="an OpenAI grader object: string_check, text_similarity, python, "
                                               "score_model (a model this server has), multi; or flywheel's {type: "
                                               "flywheel_environment, env, settings}")
    hyperparameters: ReinforcementHyperparameters | None = None


class Method(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["supervised", "dpo", "reinforcement"]
    supervised: MethodSettings | None = None
    dpo: DpoSettings | None = None
    reinforcement: ReinforcementSettings | None = None


class WebhookCreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(description="an http(s) URL that takes POSTs")
    events: list[Literal["fine_tuning.job.succeeded", "fine_tuning.job.failed", "fine_tuning.job.cancelled"]] | None = None


class WebhookEndpoint(_Out):
    id: str
    object: Literal["webhook_endpoint"]
    url: str
    events: list[str]
    created_at: int
    secret: str | None = Field(None, description="whsec_...: in the answer to POST /v1/webhooks only")


class WebhookList(_Out):
    object: Literal["list"]
    data: list[WebhookEndpoint]
    has_more: bool
    first_id: str | None
    last_id: str | None


class WebhookDeleted(_Out):
    id: str
    object: Literal["webhook_endpoint"]
    deleted: bool


class ModelDeleted(_Out):
    id: str
    object: Literal["model"]
    deleted: bool


class GraderValidateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grader: dict[str, Any]


class GraderRunRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grader: dict[str, Any]
    model_sample: str = Field(description="the answer to grade, as {{ sample.output_text }}")
    item: dict[str, Any] | None = Field(None, description="the row, as {{ item.<field> }}")


class GraderValidated(_Out):
    grader: dict[str, Any]


class GraderRunResult(_Out):
    reward: float
    metadata: dict[str, Any]
    sub_rewards: dict[str, float]
    model_grader_token_usage_per_model: dict[str, Any]


class JobCreateRequest(BaseModel):
    """POST /v1/fine_tuning/jobs, as OpenAI's API defines it."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(description="a base model this server offers (GET /v1/models) or one of your fine-tuned models")
    training_file: str = Field(description="the id of an uploaded file with purpose fine-tune")
    validation_file: str | None = None
    suffix: str | None = Field(None, max_length=64, description="part of the fine-tuned model's name")
    seed: int | None = Field(None, ge=0, le=2 ** 31 - 1)
    metadata: dict[str, str] | None = None
    method: Method | None = None
    hyperparameters: Hyperparameters | None = Field(None, description="deprecated: method.supervised.hyperparameters")


# ---------------------------------------------------------------- managed flywheels (extension)


class FlywheelProduction(_Out):
    model: str = Field(description="the model name the production alias serves now")
    version: str = Field(description="its version in the flywheel's registry")
    generation: int = Field(description="grows at every promotion and rollback")


class FlywheelTraces(_Out):
    models: list[str] = Field(description="model names whose traces feed the flywheel (its alias first)")
    failures_after_seq: int = Field(description="failures of traces after this seq count towards the trigger")


class Flywheel(_Out):
    id: str
    object: Literal["flywheel"]
    created_at: int
    model: str = Field(description="the model the flywheel started from")
    suffix: str
    status: Literal["active", "paused"]
    organization_id: str
    production_model: str = Field(description="the alias clients call: ft:<model>:<tenant>:<suffix>:production")
    production: FlywheelProduction
    traces: FlywheelTraces
    training: dict[str, Any]
    curation: dict[str, Any]
    eval: dict[str, Any]
    gate: dict[str, Any]
    trigger: dict[str, Any]
    budget_usd: float | None
    metadata: dict[str, str] | None


class FlywheelList(_Out):
    object: Literal["list"]
    data: list[Flywheel]
    has_more: bool
    first_id: str | None
    last_id: str | None


class FlywheelCycle(_Out):
    id: str
    object: Literal["flywheel.cycle"]
    flywheel_id: str
    number: int
    fine_tuning_job_id: str = Field(description="the fine-tuning job that runs the cycle (its events show each stage)")
    status: Status = Field(description="the job's status")
    reason: str = Field(description="why the cycle started")
    outcome: str | None = Field(description="promoted, rejected, waiting for more traffic, nothing to train, "
                                            "cancelled or failed; null until decided")
    promoted: bool
    decision: dict[str, Any] | None = Field(description="the gate's decision: promote, reasons, deltas, bounds")
    scores: dict[str, Any] | None = Field(description="incumbent and candidate accuracy per suite")
    new_failures: int | None
    trace_cursor: int | None
    version: str | None = Field(description="the registry version the cycle registered")
    fine_tuned_model: str | None = Field(description="the promoted model's name (null unless promoted)")
    error: JobError | None
    estimated_cost: float | None = Field(description="US dollars the cycle spent")
    created_at: int
    finished_at: int | None


class FlywheelCycleList(_Out):
    object: Literal["list"]
    data: list[FlywheelCycle]
    has_more: bool
    first_id: str | None
    last_id: str | None


class FlywheelRollbackRequest(BaseModel):
    to: str | None = Field(None, description="a version that was in production; default: the one before")
