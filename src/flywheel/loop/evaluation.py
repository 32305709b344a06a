"""Score a model folder on named suites: greedy accuracy (reward >= 1) over fixed task lists.

A suite is an environment plus the exact tasks to play, so the incumbent and the candidate of
a cycle are measured on the same tasks. Frozen regression suites come from an environment's
test split (`suite_from_config`), played in the format the suite declares: `chat` (a
raw-text task becomes one user message, rendered with the model's chat template, as
/v1/chat/completions serves it) or `completion` (the raw text, as /v1/completions serves it;
a chat task has no such form). The new-failure suite comes from a cycle's held-out replay
records, each task the failure as it was served. Besides each suite's accuracy it keeps which
tasks passed (`outcomes`, in task order, with the task ids), so the gate compares the two
models task by task.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pydantic import Field

from flywheel.config import Config, ConfigError
from flywheel.envs import load_env
from flywheel.loop.paired import Outcomes
from flywheel.types import PromptFormat, Task, prompt_format



class SuiteConfig(Config):
    """A frozen regression suite: the first `tasks` tasks of an environment's split."""

    env: str = Field(..., min_length=1, description="environment name, as in an RL config")
    settings: dict[str, Any] = Field(default_factory=dict)
    tasks: int = Field(100, ge=1)
    split: str = "test"
    seed: int = 0
    max_tokens: int = Field(16, ge=1, description="new tokens per assistant turn")
    format: PromptFormat | None = Field(None, description=(
        "play the tasks as production calls the model: chat (through the chat template) or completion "
        "(raw text); unset: the environment's own task format. The loop warns when it is not the format "
        "of production's traffic"))


@dataclass(frozen=True)
class Suite:
    name: str
    env: Any  # an Environment
    tasks: list[Task]
    max_tokens: int

    @property
    def formats(self) -> set[str]:
        """The formats its tasks are played in: "chat" (message prompts), "completion" (text)."""
        return {prompt_format(t.prompt) for t in self.tasks}


@dataclass(frozen=True)
class SuiteScores:
    scores: dict[str, float]  # suite -> greedy accuracy in [0, 1]
    tasks: dict[str, int]
    tokens_generated: int
    seconds: float
    outcomes: dict[str, Outcomes] = dataclasses.field(default_factory=dict)  # suite -> pass/fail per task
    task_ids: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # suite -> ids, in task order


def suite_from_config(name: str, cfg: SuiteConfig) -> Suite:
    env = load_env(cfg.env, **cfg.settings)
    tasks = env.tasks(cfg.split, n=cfg.tasks, seed=cfg.seed)
    if cfg.format is not None:
        tasks = [as_format(t, cfg.format, f"eval.suites.{name}.format") for t in tasks]
    return Suite(name, env, tasks, cfg.max_tokens)


def as_format(task: Task, fmt: PromptFormat, where: str) -> Task:
    """`task` played as `fmt`: a raw-text prompt as chat is one user message; a chat prompt
    has no raw-completion form (ConfigError naming `where`)."""
    if fmt == "chat":
        return task if isinstance(task.prompt, list) else dataclasses.replace(
            task, prompt=[{"role": "user", "content": task.prompt}])
    if isinstance(task.prompt, list):
        raise ConfigError(f"{where}: completion, but task {task.id!r} is a chat task (its prompt is messages); "
                          "use format: chat")
    return task


def format_warnings(suites: list[Suite], production: dict[str, int]) -> list[str]:
    """One warning per suite played in a format production's traffic does not use
    (`production`: traces per format, e.g. {"chat": 120}); none when there is no traffic."""
    served = {f for f, n in production.items() if n}
    if not served:
        return []
    return [f"suite {s.name!r} is played as {' and '.join(sorted(s.formats - served))} but production is "
            f"called as {' and '.join(sorted(served))} ({', '.join(f'{n} {f}' for f, n in sorted(production.items()))} "
            f"traces): set eval.suites.{s.name}.format" for s in suites if s.formats - served]


def _engine(model_dir: str | Path, seed: int):
    """An engine on the model, a LoRA adapter merged into its base first (the merge is what
    the adapter computes; scoring it on the packed kernels is scoring the same function)."""
    import tempfile

    from flywheel.inference import LocalEngine
    from flywheel.models.loading import is_adapter_folder
    from flywheel.train.lora import merged_folder

    if not is_adapter_folder(model_dir):
        return LocalEngine.from_path(str(model_dir), seed=seed)
    with tempfile.TemporaryDirectory(prefix="flywheel-merged-") as tmp:
        return LocalEngine.from_path(str(merged_folder(model_dir, Path(tmp) / "model")), seed=seed)


def evaluate_model(model_dir: str | Path, suites: list[Suite], *, seed: int = 0, chunk: int = 64,
                   stop: Callable[[], bool] = lambda: False) -> SuiteScores | None:
    """Greedy accuracy of the model at `model_dir` on each suite (an empty suite is skipped).
    Tasks are played `chunk` at a time and `stop()` is asked between chunks, so a stop
    request waits for one chunk at most: None when it said stop."""
    # here, not at the top: loop_config imports SuiteConfig and must not load torch
    from flywheel.models import ChatRenderer
    from flywheel.rollout.evaluate import evaluate

    t0 = time.perf_counter()
    engine = _engine(model_dir, seed)
    renderer = ChatRenderer(engine.tokenizer) if engine.tokenizer.chat_template else None
    scores, counts, outcomes, ids, generated = {}, {}, {}, {}, 0
    for suite in suites:
        passed: list[bool] = []  # per task, in task order
        for i in range(0, len(suite.tasks), chunk):
            if stop():
                return None
            result = evaluate(engine, suite.env, suite.tasks[i:i + chunk], max_tokens=suite.max_tokens,
                              renderer=renderer)
            passed += result.passed
            counts[suite.name] = counts.get(suite.name, 0) + result.episodes
            generated += result.tokens_generated
        if suite.tasks:
            scores[suite.name] = sum(passed) / counts[suite.name]
            ids[suite.name] = [t.id for t in suite.tasks]
            outcomes[suite.name] = Outcomes.of(ids[suite.name], passed)
    return SuiteScores(scores, counts, generated, time.perf_counter() - t0, outcomes, ids)
