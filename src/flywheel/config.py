"""Run configs: YAML files validated by pydantic before anything runs.

Every config model forbids unknown keys; the error names the key, where it is and the
keys that are valid there. Command-line overrides are dotted: `train.lr=1e-4`, values
parsed as YAML (`resume=true`, `data.train=[a.jsonl,b.jsonl]`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Sequence, TypeVar, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_serializer, model_validator
from pydantic_core import PydanticCustomError

Decay = Literal["cosine", "linear", "constant"]  # the lr schedule after warm-up (train/schedule.py)

C = TypeVar("C", bound="Config")


class ConfigError(ValueError):
    """A config file or override is invalid; the message says where and why."""


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# ---------------------------------------------------------------- shared pieces


class OptimConfig(Config):
    lr: float = Field(1e-4, gt=0, description="peak learning rate")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="the decay's floor as a fraction of lr")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up steps from 0 to lr")
    decay: Decay = Field("cosine", description=(
        "after warm-up, from lr down to min_lr_ratio * lr at the last step: cosine, linear (TRL's "
        "default) or constant (no decay)"))
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float | None = Field(1.0, gt=0, description="max global grad norm; null = no clipping")


class CheckpointConfig(Config):
    every: int = Field(0, ge=0, description="save every N optimizer steps; 0 = only at the end")
    keep: int = Field(2, ge=1, description="how many recent checkpoints to keep")


Logger = Literal["jsonl", "tensorboard", "wandb", "mlflow"]  # train/sinks/: one module each


class SinksConfig(Config):
    """Where a run's metrics go (train/sinks/): the JSONL file always, the others when listed."""

    loggers: list[Logger] = Field(["jsonl"], description=(
        "metric sinks. The run's metrics.jsonl is always written, listed or not (resume, reports, job "
        "events and the dashboard read it). tensorboard: event files in <output_dir>/tensorboard (extra "
        "`tensorboard`); wandb: a W&B run under <output_dir>/wandb, offline unless WANDB_API_KEY is set "
        "(WANDB_MODE wins; extra `wandb`); mlflow: one MLflow run in mlflow_tracking_uri, else "
        "MLFLOW_TRACKING_URI, else sqlite:///<output_dir>/mlflow.db (extra `mlflow`)"))
    project: str | None = Field(None, description="W&B project / MLflow experiment; default flywheel")
    run_name: str | None = Field(None, description="the W&B / MLflow run's name; default the output folder's name")
    mlflow_tracking_uri: str | None = Field(None, description=(
        "MLflow tracking URI (sqlite:///path.db, http://host:5000, ...); default MLFLOW_TRACKING_URI, "
        "else a SQLite store in the output folder"))

    @model_validator(mode="before")
    @classmethod
    def _old_tensorboard_flag(cls, data: Any) -> Any:
        if isinstance(data, dict) and "tensorboard" in data:
            raise PydanticCustomError(SET_ELSEWHERE, "{why}", {"field": "tensorboard", "why": (
                "replaced by log.loggers: write `loggers: [jsonl, tensorboard]` instead of `tensorboard: true` "
                "(or drop the line)")})
        return data


class LogConfig(SinksConfig):
    every: int = Field(1, ge=1, description="log metrics every N steps")
    progress: bool = Field(True, description="show a rich progress bar")


# ---------------------------------------------------------------- SFT


class SFTDataConfig(Config):
    train: list[str] = Field(..., min_length=1, description="JSONL files (chat or prompt/completion)")
    val: list[str] = Field(default_factory=list, description="validation JSONL files")
    val_fraction: float = Field(0.0, ge=0, lt=1, description="hold out this share of train when no val files")
    format: Literal["auto", "chat", "prompt_completion"] = "auto"
    max_length: int = Field(2048, ge=2, description="max tokens per example")
    overlong: Literal["truncate", "skip"] = Field("truncate", description=(
        "a line past max_length: cut it to max_length (a warning each) or skip it; a line cutting "
        "would leave with no trained token is skipped either way"))
    on_error: Literal["raise", "skip"] = Field(
        "raise", description="bad lines: stop with an error, or skip them with a warning each")
    add_eos: bool = Field(True, description="prompt/completion: end the completion with the eos token")


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSettings(Config):
    """Train a LoRA adapter (through peft) instead of every weight: per target projection W,
    W + (alpha / rank) B A with A (rank, in), B (out, rank); the adapter is what is saved."""

    rank: int = Field(16, ge=1, le=1024)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1, description="on the adapter's input, while training")
    targets: list[Literal[LORA_TARGETS]] = Field(list(LORA_TARGETS), min_length=1,
                                                 description="the projections adapted, in every layer")


class SFTTrainConfig(Config):
    steps: int | None = Field(None, ge=1, description="optimizer steps; null = derive from epochs")
    epochs: float = Field(1.0, gt=0)
    batch_size: int = Field(32, ge=1, description="examples per optimizer step")
    micro_batch_size: int = Field(32, ge=1, description="examples per forward/backward")
    seed: int = 0
    dropout: bool = Field(True, description="train with the model's own dropout (its config's rates); "
                                            "false: dropout off, as RL and DPO always train")
    lora: LoraSettings | None = Field(None, description="train a LoRA adapter; null: every weight")
    activation_checkpointing: bool = Field(False, description=(
        "recompute each layer's activations in the backward pass instead of keeping them: less memory, "
        "each layer's forward run twice"))
    strategy: Literal["single", "fsdp2"] = Field("single", description=(
        "single: one process; fsdp2: the learner sharded (torch FSDP2) over train.world_size local "
        "processes, each on its share of every batch (train/learner/ranks.py)"))
    world_size: int = Field(2, ge=1, description="processes (GPUs on cuda) of train.strategy=fsdp2")

    @model_validator(mode="after")
    def _checkpointing_runs_in_one_process(self):
        if self.activation_checkpointing and self.strategy == "fsdp2":
            raise ValueError("activation_checkpointing is not supported with strategy: fsdp2 yet")
        return self


class EvalConfig(Config):
    every: int = Field(0, ge=0, description="validate every N steps; 0 = only at the end")
    max_batches: int | None = Field(None, ge=1, description="cap on validation micro-batches")
    evaluator: str | None = Field(
        None, description="'module:function' called as fn(model, tokenizer) -> dict of metrics")
    stop_at: dict[str, float] = Field(default_factory=dict, description=(
        "stop after the first evaluation where every named metric reaches its value, e.g. "
        "{'eval/heldout_accuracy': 0.35} (a name ending in 'loss' must fall to it instead); "
        "needs eval.every > 0"))

    @model_validator(mode="after")
    def _stop_needs_evaluations(self):
        if self.stop_at and not self.every:
            raise ValueError(f"stop_at {self.stop_at} needs eval.every > 0: only periodic evaluations can stop early")
        return self


class SFTConfig(Config):
    model: str = Field(..., description="local Hugging Face model folder")
    output_dir: str = Field("runs/sft", description="checkpoints, final model and metrics")
    data: SFTDataConfig
    train: SFTTrainConfig = SFTTrainConfig()
    optim: OptimConfig = OptimConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    resume: bool = Field(False, description="continue from the newest complete checkpoint")
    threads: int | None = Field(None, ge=1, description="torch CPU threads; null = torch default")
    max_seconds: float | None = Field(None, gt=0, description=(
        "stop after the step that passes this many wall-clock seconds (this process) and save the final model"))
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: str = "cpu"


# ---------------------------------------------------------------- DPO


class DPODataConfig(Config):
    train: list[str] = Field(..., min_length=1, description="JSONL in the OpenAI DPO format")
    val: list[str] = Field(default_factory=list)
    max_length: int = Field(2048, ge=2, description="max tokens of prompt + response; longer pairs are skipped")
    on_error: Literal["raise", "skip"] = "raise"


class DPOTrainConfig(Config):
    steps: int | None = Field(None, ge=1, description="optimizer steps; null = derive from epochs")
    epochs: float = Field(1.0, gt=0)
    batch_size: int = Field(16, ge=1, description="preference pairs per optimizer step")
    seed: int = 0
    lora: LoraSettings | None = Field(None, description="train a LoRA adapter (the reference: the model with "
                                                        "its adapter off); null: every weight")


class DPOConfig(Config):
    model: str = Field(..., description="local model folder; also the frozen reference")
    output_dir: str = "runs/dpo"
    data: DPODataConfig
    train: DPOTrainConfig = DPOTrainConfig()
    beta: float = Field(0.1, gt=0)
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    optim: OptimConfig = OptimConfig(lr=5e-6)
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    eval: EvalConfig = EvalConfig()
    resume: bool = False
    threads: int | None = Field(None, ge=1)
    max_seconds: float | None = Field(None, gt=0, description=(
        "stop after the step that passes this many wall-clock seconds (this process) and save the final model"))
    device: str = "cpu"


# ---------------------------------------------------------------- RL


class EnvConfig(Config):
    name: str = Field(..., description="built-in environment name or 'package.module:load'")
    settings: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the loader")


class SamplingConfig(Config):
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_tokens: int = Field(16, ge=1, description="new tokens per assistant turn")


class AlgoConfig(Config):
    advantage: Literal["grpo", "dr_grpo", "rloo", "grpo_batch"] = Field("grpo", description=(
        "grpo: centred and scaled per group; dr_grpo: centred only; rloo: leave-one-out; grpo_batch: "
        "centred per group, scaled by the std of the whole step's batch (ScaleRL)"))
    objective: Literal["ppo", "cispo"] = Field("ppo", description=(
        "ppo: the clipped surrogate; cispo: the clip on a detached weight, every token keeps its "
        "gradient (MiniMax-M1); the same at train.minibatches=1"))
    eps_low: float = Field(0.2, ge=0)
    eps_high: float = Field(0.2, ge=0, description="> eps_low: DAPO clip-higher")
    aggregation: Literal["token", "sequence", "constant"] = "token"
    dynamic_sampling: bool = Field(True, description=(
        "DAPO: a group whose rewards are all equal is discarded and another task drawn in its place, "
        "up to train.draw_limit x groups_per_step groups a step (on by default: fewer steps to a "
        "target in bench/rl_ablation.py; a step whose groups are all flat trains nothing)"))
    is_cap: float = Field(2.0, gt=0, description="truncated importance-sampling cap")
    kl_beta: float = Field(0.0, ge=0, description="k3 KL penalty to the initial model; 0 = none")


class RLTrainConfig(Config):
    steps: int = Field(100, ge=1)
    groups_per_step: int = Field(8, ge=1, description="tasks per step")
    group_size: int = Field(8, ge=2, description="attempts per task (GRPO group)")
    minibatches: int = Field(1, ge=1, description=(
        "optimizer updates per step, each on groups_per_step / minibatches whole groups "
        "(PPO minibatches; more updates per sample)"))
    seed: int = 0
    draw_limit: float = Field(3.0, ge=1, description=(
        "with algo.dynamic_sampling: at most this many x groups_per_step groups are taken for one step "
        "while discarded ones are replaced; the step trains on those kept"))
    drop_solved: float | None = Field(None, gt=0, le=1, description=(
        "a train task whose group's mean reward reaches this is not drawn again (ScaleRL's "
        "no-positive-resampling uses 0.9), unless every task is; null: never dropped"))
    lora: LoraSettings | None = Field(None, description=(
        "train a LoRA adapter (rollout engines run it merged; the KL reference: the model with its "
        "adapter off); null: every weight"))
    strategy: Literal["single", "fsdp2"] = Field("single", description=(
        "single: one learner process; fsdp2: the learner sharded (torch FSDP2) over train.world_size "
        "processes (local ones, or Ray actors with rollout.ray.learner=actors), every rank updating on "
        "its share of each step's trajectories (train/learner/group.py)"))
    world_size: int = Field(2, ge=1, description="processes (GPUs on cuda) of train.strategy=fsdp2")

    @model_validator(mode="after")
    def _minibatches_fit(self):
        if self.minibatches > self.groups_per_step:
            raise ValueError(f"minibatches={self.minibatches} exceeds groups_per_step={self.groups_per_step}: "
                             "each minibatch needs at least one whole group")
        return self


class RLEvalConfig(Config):
    every: int = Field(0, ge=0, description="evaluate every N steps; 0 = only at the start and end")
    tasks: int = Field(200, ge=1, description="held-out tasks (split 'test')")
    pass_k: int = Field(1, ge=1, description="also report pass@k with k samples at the sampling temperature")


class RayConfig(Config):
    """A Ray cluster for `rollout.backend: ray` (docs/scale.md)."""

    address: str | None = Field(None, description=(
        "an existing cluster: 'auto' (the one this machine belongs to) or 'ray://host:10001'; "
        "null: start a local one for this run"))
    worker_resources: dict[str, float] = Field(default_factory=dict, description=(
        "custom resources each rollout actor needs, e.g. {env_cpu: 1} to place them on CPU "
        "environment nodes started with `ray start --resources '{\"env_cpu\": 8}'`"))
    worker_cpus: float = Field(1.0, gt=0, description="CPUs each rollout actor holds")
    worker_gpus: float = Field(0.0, ge=0, description="GPUs each rollout actor holds (its inference engine)")
    env_actors: int = Field(0, ge=0, description=(
        "environment actors the episodes run on (tool calls, sandboxes, verifiers); 0: each rollout "
        "actor runs its environment itself"))
    env_resources: dict[str, float] = Field(default_factory=dict, description=(
        "custom resources each environment actor needs, e.g. {env_cpu: 1}: CPU environment nodes"))
    env_cpus: float = Field(1.0, gt=0, description="CPUs each environment actor holds")
    namespace: str = Field("flywheel", description="the Ray namespace of the run's actors")
    weights: Literal["store", "broadcast"] = Field("store", description=(
        "how rollout actors get weights: store = the run's shared memory on the learner's node, Ray's "
        "object store elsewhere; broadcast = a torch.distributed group from the driver to every "
        "rollout actor, NCCL when the weights the driver publishes are on a GPU (a learner in the "
        "driver on CUDA, whose GPU Ray must not also give an actor) and the actors have GPUs, gloo "
        "otherwise (weights/broadcast.py)"))
    learner: Literal["driver", "actors"] = Field("driver", description=(
        "where the learner runs: in the driver process (run the driver where it should be), or as "
        "Ray actors, one per rank (train.world_size under train.strategy=fsdp2, else one), placed by "
        "learner_cpus / learner_gpus / learner_resources"))
    learner_cpus: float = Field(1.0, gt=0, description="CPUs each learner actor holds (its torch threads)")
    learner_gpus: float = Field(0.0, ge=0, description="GPUs each learner actor holds (1: it trains on CUDA)")
    learner_resources: dict[str, float] = Field(default_factory=dict, description=(
        "custom resources each learner actor needs, e.g. {learner: 1} for nodes started with that resource"))


class RolloutConfig(Config):
    workers: int | None = Field(None, ge=0, description=(
        "rollout worker processes; 0 = generate in the learner's process (synchronous only); "
        "default: 1 when max_off_policy_steps > 0, else 0"))
    threads: int | None = Field(None, ge=1, description=(
        "torch threads per worker (synchronous: while the learner's process generates); default 1 "
        "when asynchronous (small-batch decoding is bound by op dispatch, not arithmetic), else the learner's"))
    max_restarts: int = Field(3, ge=0, description="crashed workers restarted before the run stops")
    backend: Literal["local", "ray"] = Field("local", description=(
        "where rollout workers run: local processes on this machine, or Ray actors on a cluster "
        "(extra `ray`; see `ray`)"))
    ray: RayConfig = RayConfig()
    in_flight_updates: bool = Field(False, description=(
        "workers take newer weights between two decode steps, not only between work items: rows in "
        "flight go on under the new weights (keys and values recomputed), each token tagged with its "
        "version (worker processes and Ray actors: rollout.workers >= 1)"))
    refill_ahead: bool = Field(True, description=(
        "with algo.dynamic_sampling: a player plays, beside an item's tasks, as many spares as the keep "
        "rule rejected of its previous item, in one decode batch (rollout/refill.py); false: spares only "
        "after the rejections are known"))
    engine: Literal["local", "vllm"] = Field("local", description=(
        "the rollout actors' inference engine: flywheel's LocalEngine, or vLLM on a CUDA GPU (extra "
        "`vllm`; needs backend: ray, one GPU per actor by ray.worker_gpus)"))

    @model_validator(mode="after")
    def _vllm_runs_on_ray_actors(self):
        if self.engine == "vllm" and self.backend != "ray":
            raise ValueError("rollout.engine=vllm runs in Ray rollout actors: set rollout.backend=ray "
                             "(and rollout.ray.worker_gpus=1)")
        return self


class RLOptimConfig(OptimConfig):
    """RL's optimizer settings: its defaults are the winners of bench/rl_ablation.py (linear decay
    to 0, as TRL's GRPOTrainer), whether the section is left out or only partly set."""

    lr: float = Field(1e-5, gt=0, description="peak learning rate")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="the decay's floor as a fraction of lr")
    decay: Decay = Field("linear", description=(
        "after warm-up, from lr down to min_lr_ratio * lr at the last step: linear (measured best "
        "with dynamic sampling, docs/benchmarks.md), cosine or constant"))


class RLConfig(Config):
    model: str = Field(..., description="local Hugging Face model folder (e.g. an SFT warm start)")
    output_dir: str = "runs/rl"
    env: EnvConfig
    train: RLTrainConfig = RLTrainConfig()
    sampling: SamplingConfig = SamplingConfig()
    algo: AlgoConfig = AlgoConfig()
    optim: RLOptimConfig = RLOptimConfig()
    eval: RLEvalConfig = RLEvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    max_off_policy_steps: int = Field(0, ge=0, description=(
        "staleness bound k: samples may come from weights up to k versions old (0 = synchronous "
        "on-policy; 1 = generate step s + 1 while step s trains)"))
    rollout: RolloutConfig = RolloutConfig()
    max_seconds: float | None = Field(None, gt=0, description=(
        "stop after the step that passes this many wall-clock seconds (this process) and save the final model"))
    max_skipped_steps: int = Field(5, ge=1, description="stop after this many non-finite updates in a row")
    resume: bool = False
    threads: int | None = Field(None, ge=1, description=(
        "learner torch threads; default: torch's, or when asynchronous the cores the workers leave"))
    device: str = "cpu"

    @model_validator(mode="after")
    def _sampling_temperature(self):
        if self.sampling.temperature <= 0:
            raise ValueError(f"sampling.temperature must be > 0 for RL (a group of greedy samples is one answer "
                             f"repeated, and the learner trains softmax(logits / temperature)), got "
                             f"{self.sampling.temperature}")
        return self


# ---------------------------------------------------------------- loading


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """["train.lr=1e-4", "resume=true"] -> {"train": {"lr": 1e-4}, "resume": True}."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML: {e}") from None
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with another override of {part!r}")
        last = parts[-1]
        if isinstance(node.get(last), dict) and not isinstance(value, dict):
            raise ConfigError(f"override {item!r} conflicts with another override of {key}.*")
        node[last] = deep_merge(node[last], value) if isinstance(node.get(last), dict) else value
    return tree


SET_ELSEWHERE = "set_elsewhere"  # the error type of a left-out field given to overrides


class Overrides(Config):
    """Some fields of a config, the others left to their defaults (overrides_of makes them):
    dumped, only the fields given, nested overrides likewise, so a dump validates back to the
    same overrides and merges onto the config it overrides (`deep_merge`)."""

    @model_serializer(mode="wrap")
    def _only_given(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set}


def overrides_of(cls: type[C], name: str, leave_out: tuple[str, ...] = (), why: str = "") -> type[Overrides]:
    """A model of what may override `cls`: its fields less `leave_out`, each optional (not
    given: the default), a nested section (a Config) by overrides of its own, each given value
    checked as `cls` checks it, unknown fields refused as everywhere. A left-out field given
    anyway is refused naming it, with `why` (who sets it instead)."""
    fields: dict[str, Any] = {}
    for field_name, info in cls.model_fields.items():
        if field_name in leave_out:
            continue
        kind = info.annotation
        if isinstance(kind, type) and issubclass(kind, Config):
            kind = overrides_of(kind, f"{name}_{field_name}")
        elif info.metadata:  # its bounds (gt=0, ...) hold for a value given
            kind = Annotated[(kind, *info.metadata)]  # a tuple: Python 3.10 has no star in an index
        fields[field_name] = (kind | None, Field(None, description=info.description))

    def refuse_left_out(data: Any) -> Any:
        given = sorted(set(data) & set(leave_out)) if isinstance(data, dict) else []
        if given:
            raise PydanticCustomError(SET_ELSEWHERE, "{why}", {"field": given[0], "why": why or "not overridable here"})
        return data

    validators = {"refuse_left_out": model_validator(mode="before")(refuse_left_out)} if leave_out else {}
    return create_model(name, __base__=Overrides, __validators__=validators, **fields)


def deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: str | Path | None, cls: type[C], overrides: Sequence[str] = ()) -> C:
    """Read YAML at `path` (or nothing), apply dotted overrides, validate as `cls`."""
    data: dict[str, Any] = {}
    where = "command line"
    if path is not None:
        path = Path(path)
        where = str(path)
        if not path.exists():
            raise ConfigError(f"config file {where!r} does not exist")
        if not path.is_file():
            raise ConfigError(f"config path {where!r} is not a file")
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"{where}: not UTF-8 text (byte {e.start}: {e.reason})") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            if mark is not None:
                raise ConfigError(f"{where}: line {mark.line + 1}: invalid YAML: {getattr(e, 'problem', e)}") from None
            raise ConfigError(f"{where}: invalid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{where}: the top level must be a mapping of keys, got {type(loaded).__name__}")
        data = loaded or {}
    data = deep_merge(data, parse_overrides(overrides))
    return validate(data, cls, where)


def validate(data: dict, cls: type[C], where: str = "config") -> C:
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{where}: invalid {cls.__name__}:\n" + _explain(e, cls)) from None


def _explain(error: ValidationError, cls: type[BaseModel]) -> str:
    lines = []
    for err in error.errors():
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == SET_ELSEWHERE:
            lines.append(f"  {'.'.join([*loc.split('.'), err['ctx']['field']]).strip('.')}: {err['msg']}")
        elif err["type"] == "extra_forbidden":
            valid = sorted(_model_at(cls, err["loc"][:-1]).model_fields)
            lines.append(f"  {loc}: unknown key; valid keys here are: {', '.join(valid)}")
        else:
            lines.append(f"  {loc or '(top)'}: {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)


def _model_at(cls: type[BaseModel], loc: Sequence[Any]) -> type[BaseModel]:
    """The config model found by walking field names `loc` from `cls` (best effort)."""
    model = cls
    for part in loc:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        models = [a for a in (get_args(ann) or (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(models) != 1:  # (an optional section, as overrides hold, is its model)
            break
        model = models[0]
    return model
