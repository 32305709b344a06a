"""The body of POST /v1/fine_tuning/jobs, validated as OpenAI's fine-tuning API defines it.

`JobRequest.parse(body)` returns the request or raises `RequestError` naming the field
(`param`, dotted as OpenAI names it: "method.supervised.hyperparameters.n_epochs") and what was
wrong with its value. Unknown fields are refused rather than ignored, so a client never
believes an option took effect when it did not. The legacy top-level `hyperparameters`
(OpenAI's deprecated form) is accepted for supervised jobs and becomes
`method.supervised.hyperparameters`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

METHODS = ("supervised", "dpo", "reinforcement")
# per method: hyperparameter -> (kind, low, high); "auto" is always allowed
HYPERPARAMETERS: dict[str, dict[str, tuple[type, float, float]]] = {
    "supervised": {"n_epochs": (int, 1, 50), "batch_size": (int, 1, 256),
                   "learning_rate_multiplier": (float, 1e-3, 100.0), "lora": (dict, 0, 0)},
    "dpo": {"n_epochs": (int, 1, 50), "batch_size": (int, 1, 256),
            "learning_rate_multiplier": (float, 1e-3, 100.0), "beta": (float, 1e-3, 10.0), "lora": (dict, 0, 0)},
    "reinforcement": {"n_epochs": (int, 1, 50), "batch_size": (int, 1, 256),
                      "learning_rate_multiplier": (float, 1e-3, 100.0), "eval_interval": (int, 1, 10_000),
                      "eval_samples": (int, 1, 1_000), "compute_multiplier": (float, 1e-3, 100.0),
                      "reasoning_effort": (str, 0, 0), "lora": (dict, 0, 0)},
}
TOP_LEVEL = {"model", "training_file", "validation_file", "suffix", "seed", "metadata", "method", "hyperparameters",
             "integrations"}
SUFFIX_MAX = 64
METADATA_MAX_KEYS, METADATA_KEY_MAX, METADATA_VALUE_MAX = 16, 64, 512


class RequestError(ValueError):
    """A request field is invalid: `param` names it as the API does, the message says why."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class JobRequest:
    model: str
    training_file: str
    method_type: str
    hyperparameters: dict[str, Any]  # as given: a value or "auto" per named hyperparameter
    grader: dict[str, Any] | None = None  # reinforcement only
    validation_file: str | None = None
    suffix: str | None = None
    seed: int | None = None
    metadata: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, body: Any) -> JobRequest:
        if not isinstance(body, dict):
            raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
        unknown = sorted(set(body) - TOP_LEVEL)
        if unknown:
            raise RequestError(f"unknown field {unknown[0]!r}; valid fields: {', '.join(sorted(TOP_LEVEL))}",
                               unknown[0])
        if body.get("integrations"):
            raise RequestError("integrations are not supported by this server (metrics are in the job's events)",
                               "integrations")
        model = _string(body, "model", required=True)
        training_file = _string(body, "training_file", required=True)
        validation_file = _string(body, "validation_file")
        suffix = _string(body, "suffix")
        if suffix is not None and (len(suffix) > SUFFIX_MAX or not all(c.isalnum() or c in "-_" for c in suffix)):
            raise RequestError(f"suffix must be at most {SUFFIX_MAX} letters, digits, '-' or '_', got {suffix!r}",
                               "suffix")
        seed = body.get("seed")
        if seed is not None and (type(seed) is not int or not 0 <= seed < 2 ** 31):
            raise RequestError(f"seed must be an integer in [0, 2147483647], got {seed!r}", "seed")
        method_type, hyper, grader = _method(body)
        return cls(model=model, training_file=training_file, method_type=method_type, hyperparameters=hyper,
                   grader=grader, validation_file=validation_file, suffix=suffix, seed=seed,
                   metadata=_metadata(body.get("metadata")))

    def method(self, resolved: dict[str, Any] | None = None) -> dict[str, Any]:
        """OpenAI's `method` object, with `resolved` hyperparameters when given."""
        inner: dict[str, Any] = {"hyperparameters": resolved if resolved is not None else self.hyperparameters}
        if self.grader is not None:
            inner["grader"] = self.grader
        return {"type": self.method_type, self.method_type: inner}


def _string(body: dict, name: str, required: bool = False) -> str | None:
    value = body.get(name)
    if value is None:
        if required:
            raise RequestError(f"{name} is required", name)
        return None
    if not isinstance(value, str) or not value:
        raise RequestError(f"{name} must be a non-empty string, got {value!r}", name)
    return value


def _method(body: dict) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
    method = body.get("method")
    legacy = body.get("hyperparameters")
    if method is None:
        method = {"type": "supervised", "supervised": {"hyperparameters": legacy or {}}}
    elif legacy:
        raise RequestError("give hyperparameters inside method.<type>, not also at the top level", "hyperparameters")
    if not isinstance(method, dict):
        raise RequestError(f"method must be an object, got {method!r}", "method")
    kind = method.get("type")
    if kind not in METHODS:
        raise RequestError(f"method.type must be one of {', '.join(METHODS)}, got {kind!r}", "method.type")
    extra = sorted(set(method) - {"type", kind})
    if extra:
        raise RequestError(f"method.{extra[0]} does not belong to a {kind} job", f"method.{extra[0]}")
    inner = method.get(kind) or {}
    if not isinstance(inner, dict):
        raise RequestError(f"method.{kind} must be an object", f"method.{kind}")
    allowed = {"hyperparameters"} | ({"grader"} if kind == "reinforcement" else set())
    extra = sorted(set(inner) - allowed)
    if extra:
        raise RequestError(f"unknown field method.{kind}.{extra[0]}; valid: {', '.join(sorted(allowed))}",
                           f"method.{kind}.{extra[0]}")
    hyper = inner.get("hyperparameters") or {}
    if not isinstance(hyper, dict):
        raise RequestError(f"method.{kind}.hyperparameters must be an object", f"method.{kind}.hyperparameters")
    checked = {name: _hyperparameter(kind, name, value) for name, value in hyper.items()}
    grader = inner.get("grader")
    if kind == "reinforcement":
        if not isinstance(grader, dict) or not grader.get("type"):
            raise RequestError("a reinforcement job needs method.reinforcement.grader, an object with a type",
                               "method.reinforcement.grader")
    return kind, checked, grader


def _hyperparameter(kind: str, name: str, value: Any) -> Any:
    param = f"method.{kind}.hyperparameters.{name}"
    spec = HYPERPARAMETERS[kind].get(name)
    if spec is None:
        raise RequestError(f"unknown hyperparameter {name!r} for a {kind} job; valid: "
                           f"{', '.join(sorted(HYPERPARAMETERS[kind]))}", param)
    if value == "auto":
        return value
    kind_of, low, high = spec
    if kind_of is dict:
        return _lora(kind, value, param)
    if kind_of is str:
        if value not in ("low", "medium", "high", "default"):
            raise RequestError(f"{name} must be one of low, medium, high, default or 'auto', got {value!r}", param)
        return value
    number_ok = type(value) is int if kind_of is int else type(value) in (int, float)
    if not number_ok or not low <= value <= high:
        what = "an integer" if kind_of is int else "a number"
        raise RequestError(f"{name} must be 'auto' or {what} in [{low:g}, {high:g}], got {value!r}", param)
    return kind_of(value)


def _lora(kind: str, value: Any, param: str) -> dict[str, Any] | str:
    """lora: "full" (train every weight), or {rank, alpha, dropout, targets} (a LoRA adapter)."""
    if value == "full":
        return value
    if not isinstance(value, dict):
        raise RequestError(f"lora must be 'auto', 'full' or an object {{rank, alpha, dropout, targets}}, got {value!r}",
                           param)
    from pydantic import ValidationError

    from flywheel.config import LoraSettings

    try:
        return LoraSettings.model_validate(value).model_dump()
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise RequestError(f"lora.{where}: {first['msg']}, got {first.get('input')!r}", f"{param}.{where}") from None


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > METADATA_MAX_KEYS:
        raise RequestError(f"metadata must be an object of at most {METADATA_MAX_KEYS} string pairs", "metadata")
    for k, v in value.items():
        if not isinstance(v, str) or len(k) > METADATA_KEY_MAX or len(v) > METADATA_VALUE_MAX:
            raise RequestError(f"metadata[{k!r}]: keys are at most {METADATA_KEY_MAX} characters and values "
                               f"strings of at most {METADATA_VALUE_MAX}", f"metadata.{k}")
    return dict(value)
