"""graded: a reinforcement fine-tuning job's rows as a single-turn chat environment, each answer
scored by the job's grader (envs/graders.py).

    load(train="rows.jsonl", test=None, grader={...}, models={name: folder})

A row is OpenAI's reinforcement format: `messages` (the prompt), optional `tools`, and any
other fields the grader reads as {{ item.<field> }}. The reward is the grader's score of the
answer; metric `grade` repeats it. `test` rows are the held-out set; without them the train
rows are split by a hash of their messages (envs/splits.py): a fifth is held out, so a job's
evaluations never score rows it trains on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flywheel.canonical import canonical
from flywheel.envs.base import Env, Environment, check_split
from flywheel.envs.graders import LocalScorer, build_grader, sample_of
from flywheel.envs.rubric import EpisodeState, Rubric
from flywheel.envs.splits import side_of
from flywheel.envs.tool_env import SingleTurnEnv
from flywheel.types import Task


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise ValueError(f"{path}:{number}: not valid JSON ({e})") from None
    return rows


class GradedEnvironment(Environment):
    name = "graded"
    description = "chat prompts from a reinforcement file, answers scored by an OpenAI-style grader"
    answer_doc = "unused: the grader reads the task's row (metadata.item)"

    def __init__(self, train: str | Path, grader: dict[str, Any], test: str | Path | None = None,
                 models: dict[str, str] | None = None):
        """models: score_model graders' model names -> local folders."""
        self.grader = build_grader(grader, score_model=LocalScorer(models) if models else None)
        rows = read_rows(train)
        self.train_rows = rows
        if test is None:
            self.train_rows = [r for r in rows if side_of(self._key(r)) == "train"]
            self.test_rows = [r for r in rows if side_of(self._key(r)) == "test"]
            if not self.test_rows and len(self.train_rows) > 1:  # the hash put a small file wholly on one side
                self.test_rows = [self.train_rows.pop()]
        else:
            self.test_rows = read_rows(test)
        self.rubric = Rubric().add(self._grade, name="grade")

    @staticmethod
    def _key(row: dict[str, Any]) -> str:
        return "graded:" + canonical(row.get("messages"))

    def tasks(self, split: str = "train", n: int | None = None, seed: int = 0) -> list[Task]:
        check_split(split)
        rows = self.train_rows if split == "train" else self.test_rows
        tasks = [Task(id=f"{split}-{i}", prompt=r["messages"], tools=r.get("tools"), split=split,
                      metadata={"item": r}) for i, r in enumerate(rows)]
        return tasks if n is None else tasks[:n]

    def problem_key(self, task: Task) -> str:
        return self._key(task.metadata["item"])

    def make_env(self, task: Task) -> Env:
        return SingleTurnEnv(task, self.rubric)

    def _grade(self, state: EpisodeState) -> float:
        return self.grader.grade(sample_of(state.final_text or ""), state.task.metadata["item"])


def load(train: str, grader: dict[str, Any], test: str | None = None,
         models: dict[str, str] | None = None) -> GradedEnvironment:
    return GradedEnvironment(train, grader, test, models)
