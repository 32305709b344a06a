"""A managed flywheel's loop config: the service's checked request (jobs/flywheel_request.py,
as stored in the flywheel's row) turned into the LoopConfig that `run_cycle` runs, with the
paths only the server knows (where the flywheel's state lives, where the traces are) filled
in. The single-tenant daemon reads a LoopConfig from a file instead; both run the same cycle.

Learning rates a request leaves null are the fine-tuning API's: the method's base rate, ten
times that for a LoRA adapter (jobs/hyperparameters.py).
"""

from __future__ import annotations

from typing import Any

from flywheel.config import LoraSettings, validate
from flywheel.jobs.flywheel_request import FlywheelSpec, StoredSuite
from flywheel.jobs.hyperparameters import BASE_LR, LORA_LR_FACTOR, micro_batch
from flywheel.loop.loop_config import LoopConfig

_METHOD = {"sft": "supervised", "dpo": "dpo", "rl": "reinforcement"}
RL_EVAL_TASKS = 32  # held-out tasks the rl stage scores itself on (a progress signal; the gate decides)
GRADED_ENV = "flywheel.envs.graded:load"  # a file's rows scored by a grader (envs/graded.py)


def suite_config(suite: StoredSuite) -> dict[str, Any]:
    """A flywheel's suite as the loop's SuiteConfig: an env as it is; a graded file (its `path`,
    filled in by the server from the tenant's file id) as the graded environment, every row held
    out."""
    common = {k: getattr(suite, k) for k in ("tasks", "max_tokens", "format") if getattr(suite, k) is not None}
    if suite.env is not None:
        return {"env": suite.env, "settings": suite.settings, **common}
    return {"env": GRADED_ENV, "settings": {"train": suite.path, "test": suite.path, "grader": suite.grader}, **common}


def lora_setting(value: str | LoraSettings) -> dict[str, Any] | None:
    """"auto" -> the default adapter, "full" -> None (every weight), settings as they are."""
    if value == "auto":
        return LoraSettings().model_dump()
    return None if value == "full" else value.model_dump()


def managed_config(spec: FlywheelSpec, *, data_dir: str, traces_url: str, hardware: str) -> LoopConfig:
    t = spec.training
    lora = lora_setting(t.lora)

    def lr(stage: str) -> float:
        given = getattr(t, stage).learning_rate
        return given if given is not None else BASE_LR[_METHOD[stage]] * (LORA_LR_FACTOR if lora else 1.0)

    sft, rl, dpo = t.sft, t.rl, t.dpo
    quiet = {"progress": False}
    return validate({
        "data_dir": data_dir, "traces_url": traces_url, "hardware": hardware,
        "curation": spec.curation.model_dump(exclude_none=True),
        "train": {
            "order": t.order, "min_examples": t.min_examples, "replay_ratio": t.replay_ratio,
            "min_replay": t.min_replay, "max_usd": spec.budget_usd,
            "sft": {"train": {"steps": sft.steps, "batch_size": sft.batch_size,
                              "micro_batch_size": micro_batch(sft.batch_size), "lora": lora},
                    "optim": {"lr": lr("sft")}, "log": quiet},
            "rl": {"train": {"steps": rl.steps, "groups_per_step": rl.batch_size, "group_size": rl.group_size,
                             "lora": lora},
                   "sampling": {"temperature": 1.0, "max_tokens": rl.max_tokens}, "optim": {"lr": lr("rl")},
                   "eval": {"tasks": RL_EVAL_TASKS}, "log": quiet},
            "dpo": {"train": {"steps": dpo.steps, "batch_size": dpo.batch_size, "lora": lora},
                    "beta": dpo.beta, "optim": {"lr": lr("dpo")}, "log": quiet}},
        "eval": {"suites": {name: suite_config(s) for name, s in spec.eval.suites.items()},
                 "new_failures_max_tokens": spec.eval.new_failures_max_tokens,
                 "new_failures_max": max(spec.eval.new_failures_max, spec.gate.min_new_failures)},
        "gate": spec.gate.model_dump(),
        "trigger": {"min_new_failures": spec.trigger.min_new_failures, "every_s": spec.trigger.every_seconds},
        "serve": {"enabled": False},
    }, LoopConfig, where="flywheel")
