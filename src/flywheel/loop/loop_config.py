"""The flywheel's config (`flywheel loop cycle|run CONFIG`): where its state lives, how traces
are curated, what a cycle trains, which suites the gate reads, and when a cycle starts.

A cycle's training stages take overrides of the usual SFT / RL / DPO configs *minus* what the
cycle fills in (model, output_dir, env, resume): typed models (config.py `overrides_of`), so an
unknown field or a bad value fails when the loop config is read. `stage_config` merges them
with what the cycle fills in, and `check_stages` does that once at load time, with stand-in
paths, for the rules that span fields (batch sizes that divide, ...). What a
data_dir keeps of finished work is the `retention` section (retention.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from flywheel import locations
from flywheel.config import Config, DPOConfig, RLConfig, SFTConfig, SinksConfig, deep_merge, overrides_of, validate
from flywheel.loop.curation_rules import CurationConfig
from flywheel.loop.evaluation import SuiteConfig
from flywheel.loop.gate import GateConfig
from flywheel.loop.retention import RetentionConfig, with_checkpoint_keep

Stage = Literal["sft", "rl", "dpo"]
_FILLED = {"sft": ("model", "output_dir", "resume"), "rl": ("model", "output_dir", "resume", "env"),
           "dpo": ("model", "output_dir", "resume")}
_CLASSES = {"sft": SFTConfig, "rl": RLConfig, "dpo": DPOConfig}
_BY_CYCLE = "set by the cycle; remove it from the loop config"
SFTStage = overrides_of(SFTConfig, "SFTStage", _FILLED["sft"], _BY_CYCLE)
RLStage = overrides_of(RLConfig, "RLStage", _FILLED["rl"], _BY_CYCLE)
DPOStage = overrides_of(DPOConfig, "DPOStage", _FILLED["dpo"], _BY_CYCLE)


AnchorLoss = Literal["imitate", "distill"]  # how an SFT stage trains its anchor rows


class CycleTrainConfig(Config):
    order: list[Stage] = Field(default_factory=lambda: ["sft", "rl", "dpo"],
                               description="stages in the order they run; each starts from the previous one's model")
    min_examples: int = Field(4, ge=1, description="a stage with fewer curated train items is skipped")
    replay_ratio: float = Field(1.0, ge=0, description=(
        "SFT also rehearses the model's own verified answers (curated replay rows): this many per SFT example"))
    min_replay: int = Field(0, ge=0, description=(
        "replay rows in an SFT stage at least (when curated): a few corrections are not trained alone"))
    anchor_data: list[str] = Field(default_factory=list, description=(
        "SFT files (JSONL, chat or prompt/completion rows) every SFT stage rehearses: skills production "
        "traffic may not exercise, e.g. the base model's own SFT data"))
    anchor_rows: int = Field(256, ge=0, description="rows sampled from anchor_data per SFT stage")
    anchor_loss: AnchorLoss = Field("imitate", description=(
        "imitate: anchor rows train on their text (cross-entropy); distill: toward the distribution of "
        "the model with the stage's LoRA adapter off at their tokens (forward KL; needs sft.train.lora)"))
    rl_keep: Literal["if_better", "always"] = Field("if_better", description=(
        "if_better: the rl stage trains on a hash-split part of the curated RL tasks and is evaluated "
        "before and after on the rest (rl_check_fraction, at most rl_check_max, never the gate's new "
        "failures); the cycle keeps its model only when greedy success there rose, else the candidate "
        "is the model before it, and the log says why. always: keep it"))
    rl_check_fraction: float = Field(0.25, gt=0, lt=1, description="share of curated RL train tasks kept to check rl")
    rl_check_max: int = Field(64, ge=1, description="at most this many rl check tasks are played")
    max_seconds: float | None = Field(None, gt=0, description="wall-clock budget for all stages of a cycle")
    max_usd: float | None = Field(None, gt=0, description="dollar budget (catalog price of `hardware` x seconds)")
    sft: SFTStage = Field(default_factory=SFTStage, description="SFTConfig fields (model, output_dir, data.train filled in)")
    rl: RLStage = Field(default_factory=RLStage, description="RLConfig fields (model, output_dir, env filled in)")
    dpo: DPOStage = Field(default_factory=DPOStage, description="DPOConfig fields (model, output_dir, data.train filled in)")


class CycleEvalConfig(Config):
    suites: dict[str, SuiteConfig] = Field(default_factory=dict, description="frozen regression suites by name")
    new_failures_max_tokens: int = Field(16, ge=1, description="new tokens per turn on the new-failure suite")
    new_failures_max: int = Field(200, ge=1, description=(
        "cap on new-failure tasks played per model; at least gate.min_new_failures"))


class TriggerConfig(Config):
    min_new_failures: int = Field(20, ge=1, description=(
        "start a cycle when this many failed traces arrived since the last (only curation.heldout_fraction "
        "of them become held-out new failures, which the gate counts against gate.min_new_failures); after a "
        "cycle that waited for more traffic, when this many more arrived"))
    every_s: float | None = Field(None, gt=0, description="also start one on this schedule (seconds)")
    poll_s: float = Field(5.0, gt=0, description="how often the daemon looks")


class LoopServeConfig(Config):
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)


class LoopConfig(Config):
    data_dir: str = Field(default_factory=lambda: str(locations.data_dir()), description=(
        "traces.db, registry/, cycles/, ledger.jsonl; default $FLYWHEEL_DATA_DIR, else ./flywheel-data"))
    traces_url: str | None = Field(None, description="trace store URL; default sqlite:///<data_dir>/traces.db")
    hardware: str = Field("cpu-2core", description="catalog entry whose price costs this machine's seconds")
    curation: CurationConfig = Field(default_factory=CurationConfig)
    train: CycleTrainConfig = Field(default_factory=CycleTrainConfig)
    eval: CycleEvalConfig = Field(default_factory=CycleEvalConfig)
    gate: GateConfig = Field(default_factory=GateConfig)
    trigger: TriggerConfig = Field(default_factory=TriggerConfig)
    serve: LoopServeConfig = Field(default_factory=LoopServeConfig)
    retention: RetentionConfig = Field(default_factory=RetentionConfig)
    log: SinksConfig | None = Field(None, description=(
        "metric sinks of the loop: each finished cycle's figures (gate, scores, stages; step = cycle number) "
        "go to <data_dir>/cycle_metrics.jsonl and these loggers (loop/cycle_metrics.py), and each stage "
        "logs to them too unless train.<stage>.log says otherwise; unset: no cycle figures"))

    @model_validator(mode="after")
    def _suite_names(self) -> LoopConfig:
        if self.gate.new_failures in self.eval.suites:
            raise ValueError(f"eval.suites: {self.gate.new_failures!r} is the new-failure suite's name; "
                             "name regression suites otherwise")
        if self.eval.new_failures_max < self.gate.min_new_failures:
            raise ValueError(f"eval.new_failures_max {self.eval.new_failures_max} < gate.min_new_failures "
                             f"{self.gate.min_new_failures}: no cycle could ever decide")
        return self

    @property
    def root(self) -> Path:
        return Path(self.data_dir)

    @property
    def trace_url(self) -> str:
        return self.traces_url or f"sqlite:///{self.root / 'traces.db'}"


def stage_config(cfg: LoopConfig, stage: Stage, **filled: Any):
    """The stage's config from `cfg.train.<stage>` plus what the cycle fills in, keeping
    `retention.keep_checkpoints` checkpoints unless it sets checkpoint.keep; errors name the
    field as `train.<stage>.<path>`."""
    base = with_checkpoint_keep(getattr(cfg.train, stage).model_dump(), cfg.retention.keep_checkpoints)
    if cfg.log is not None:  # the loop's sinks, under the stage's own log settings; run `c3-sft`
        run_name = f"{Path(filled.get('output_dir', stage)).parent.name}-{stage}"
        base = deep_merge({"log": {**cfg.log.model_dump(exclude_none=True), "run_name": run_name}}, base)
    return validate(deep_merge(base, filled), _CLASSES[stage], where=f"train.{stage}")


def check_stages(cfg: LoopConfig) -> None:
    """Validate every stage's whole config, with stand-ins for what the cycle fills in: the
    rules that span fields, which the overrides alone cannot check."""
    placeholders = {
        "sft": dict(model="m", output_dir="o", resume=True, data={"train": ["t.jsonl"], "format": "chat"}),
        "rl": dict(model="m", output_dir="o", resume=True, env={"name": "replay", "settings": {"train": "t.jsonl"}}),
        "dpo": dict(model="m", output_dir="o", resume=True, data={"train": ["t.jsonl"]}),
    }
    for stage in cfg.train.order:
        stage_config(cfg, stage, **placeholders[stage])

