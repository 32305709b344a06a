"""`POST /v1/flywheels`, checked: what a tenant may set of its managed flywheel.

The body names the model to start from, which traces feed it, how traces are judged and
curated, what a cycle trains (stages, LoRA, steps, learning rates, a dollar budget), the
frozen suites and the gate, and the trigger. It is deliberately narrower than a loop config
(loop/loop_config.py): no server paths, only built-in environments, so one tenant's request
can read nothing of the server's but its own traces. `FlywheelRequest.parse` raises
RequestError naming the field (`param`, as the API reports it) and what was wrong.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from flywheel.config import Config, LoraSettings
from flywheel.jobs.requests import SUFFIX_MAX, RequestError

BUILTIN_ENVS = ("arithmetic", "calculator", "code_repair", "reasoning_gym")  # envs/registry.py's, less replay (files)


class StageSettings(Config):
    """One training stage of a cycle. batch_size: examples (sft), pairs (dpo) or prompts (rl)
    per step; learning_rate null: the service's default for the stage (LoRA or full)."""

    steps: int = Field(20, ge=1, le=100_000)
    batch_size: int = Field(8, ge=1, le=512)
    learning_rate: float | None = Field(None, gt=0, le=1)
    group_size: int = Field(4, ge=2, le=64, description="rl: samples per prompt")
    max_tokens: int = Field(64, ge=1, le=8192, description="rl: new tokens per sample")
    beta: float = Field(0.1, gt=0, le=10, description="dpo")


class TrainingSpec(Config):
    order: list[Literal["sft", "rl", "dpo"]] = Field(["sft"], min_length=1)
    lora: Literal["auto", "full"] | LoraSettings = "auto"
    sft: StageSettings = StageSettings()
    rl: StageSettings = StageSettings()
    dpo: StageSettings = StageSettings()
    min_examples: int = Field(4, ge=1, description="a stage with fewer curated items is skipped")
    replay_ratio: float = Field(1.0, ge=0, le=100)
    min_replay: int = Field(0, ge=0)


class CurationSpec(Config):
    heldout_fraction: float = Field(0.25, ge=0, le=1)
    fail_below: float = 0.5
    pass_at: float = 1.0
    failure_labels: list[str] | None = None
    success_labels: list[str] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "CurationSpec":
        if self.fail_below > self.pass_at:
            raise ValueError(f"fail_below ({self.fail_below}) must not exceed pass_at ({self.pass_at})")
        both = {x.strip().lower() for x in self.failure_labels or []} & {x.strip().lower() for x in self.success_labels or []}
        if both:
            raise ValueError(f"labels both failure and success: {sorted(both)}")
        return self


class SuiteSpec(Config):
    """A frozen regression suite: the first `tasks` held-out tasks of a built-in environment
    (`env`, `settings`), or the rows of one of your files (`file`, in the reinforcement
    format) scored by a `grader` (a task passes when the grader gives it 1)."""

    env: str | None = None
    settings: dict[str, Any] = Field(default_factory=dict)
    file: str | None = Field(None, description="a file id: rows in the reinforcement format")
    grader: dict[str, Any] | None = Field(None, description="an OpenAI-style grader of the file's rows")
    tasks: int = Field(100, ge=1, le=10_000)
    max_tokens: int = Field(16, ge=1, le=8192)
    format: Literal["chat", "completion"] | None = None

    @model_validator(mode="after")
    def _env_or_graded_file(self) -> "SuiteSpec":
        if (self.env is None) == (self.file is None):
            raise ValueError("a suite names an env, or a file with its grader (not both)")
        if self.file is not None and self.grader is None:
            raise ValueError("a suite of a file needs its grader")
        if self.env is None and self.settings:
            raise ValueError("settings are an env's; a file's suite has its grader")
        return self

    @field_validator("env")
    @classmethod
    def _builtin(cls, env: str | None) -> str | None:
        if env is not None and env not in BUILTIN_ENVS:
            raise ValueError(f"suites play built-in environments only ({', '.join(BUILTIN_ENVS)}), got {env!r}")
        return env

    @field_validator("settings")
    @classmethod
    def _plain(cls, settings: dict[str, Any]) -> dict[str, Any]:
        for key, value in settings.items():  # no paths: a tenant's settings open no server file
            if not (isinstance(value, (int, float, bool)) or (isinstance(value, str) and "/" not in value
                                                                and "\\" not in value and len(value) <= 100)):
                raise ValueError(f"settings.{key}: numbers, booleans and short names only, got {value!r}")
        return settings


class EvalSpec(Config):
    suites: dict[str, SuiteSpec] = Field(default_factory=dict, description="frozen regression suites by name")
    new_failures_max_tokens: int = Field(16, ge=1, le=8192)
    new_failures_max: int = Field(200, ge=1, le=10_000)

    @field_validator("suites")
    @classmethod
    def _names(cls, suites: dict[str, SuiteSpec]) -> dict[str, SuiteSpec]:
        if "new_failures" in suites:
            raise ValueError("'new_failures' is the new-failure suite's name; name regression suites otherwise")
        return suites


class GateSpec(Config):
    delta: float = Field(0.05, ge=0, le=1)
    epsilon: float = Field(0.02, ge=0, le=1)
    confidence: float = Field(0.95, ge=0.5, lt=1)
    min_new_failures: int = Field(20, ge=1)


class TriggerSpec(Config):
    min_new_failures: int = Field(20, ge=1, description="start a cycle when this many failed traces arrived")
    every_seconds: float | None = Field(None, ge=60, description="also start one on this schedule")


class TracesSpec(Config):
    models: list[str] = Field(default_factory=list, description=(
        "model names whose traces feed the flywheel besides its production alias's (e.g. traces another "
        "stack posts naming its own model)"))


class FlywheelSettings(Config):
    """What a request sets and the flywheel's row keeps alike (FlywheelRequest, FlywheelSpec)."""

    traces: TracesSpec = TracesSpec()
    training: TrainingSpec = TrainingSpec()
    curation: CurationSpec = CurationSpec()
    gate: GateSpec = GateSpec()
    trigger: TriggerSpec = TriggerSpec()
    budget_usd: float | None = Field(None, gt=0, description="dollars a cycle's training may spend")


class FlywheelRequest(FlywheelSettings):
    model: str = Field(..., min_length=1, max_length=300)
    suffix: str = Field("flywheel", min_length=1, max_length=SUFFIX_MAX, pattern=r"^[A-Za-z0-9_-]+$")
    eval: EvalSpec = EvalSpec()
    metadata: dict[str, str] = Field(default_factory=dict, max_length=16)

    @classmethod
    def parse(cls, body: Any) -> "FlywheelRequest":
        if not isinstance(body, dict):
            raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
        try:
            return cls.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            for err in e.errors():  # a union's errors: the one of its object form says more than "not 'auto'"
                if "literal" not in str(err["loc"]) and any(str(x).startswith("LoraSettings") for x in err["loc"]):
                    first = err
                    break
            param = ".".join(str(x) for x in first["loc"] if not str(x).startswith(("function-after", "literal[",
                                                                                      "LoraSettings"))) or None
            got = f", got {first['input']!r}" if first["type"] not in ("missing", "value_error") else ""
            raise RequestError(f"{param}: {first['msg']}{got}", param) from None

    def spec(self) -> "FlywheelSpec":
        """What the flywheel row keeps of the request, defaults filled in (the server adds the
        rest: its suites' file paths, the first version, the traces' model names)."""
        return FlywheelSpec.model_validate(self.model_dump(exclude={"model", "suffix", "metadata"}))


class StoredSuite(SuiteSpec):
    path: str | None = Field(None, description="where the server keeps `file` (filled in by the server)")


class StoredEval(EvalSpec):
    suites: dict[str, StoredSuite] = Field(default_factory=dict)


class FlywheelSpec(FlywheelSettings):
    """A managed flywheel as its row keeps it (`spec`, JSON): the request's settings, less the
    model and suffix the row has columns for, plus what the server filled in. Read a row's with
    `FlywheelSpec.model_validate(row["spec"])`."""

    eval: StoredEval = StoredEval()
    initial_version: str | None = Field(None, description="the registry version the flywheel started from")
    trace_models: list[str] = Field(default_factory=list, description=(
        "the model names whose traces feed it: its production alias, then traces.models"))
