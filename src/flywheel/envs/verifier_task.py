"""The `task` of a verifier (feedback `verifier: {"env": NAME, "task": {...}}`): what a client
sends to have a failed trace replayed and graded by an environment, told field by field for
`flywheel env show` and the API's docs. Environments say only what their `answer` is and what
their grader reads from `metadata` (Environment.answer_doc, metadata_doc); the rest is here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from flywheel.envs.base import Environment


@dataclass(frozen=True)
class TaskField:
    name: str
    required: bool
    text: str


TASK_FIELDS = (
    TaskField("answer", True, "the reference the verifier grades against (any JSON)"),
    TaskField("prompt", False, "a record only: the replay plays the trace's own prompt as it was served (a chat "
                               "trace's messages through the last user message, a raw completion's text); "
                               "if given, chat messages or a non-empty string, kept as `verifier_prompt`"),
    TaskField("id", False, "a non-empty string; absent: the trace's id"),
    TaskField("tools", False, "ignored on replay: the tools the trace offered are the ones replayed"),
    TaskField("metadata", False, "an object: what the environment reads besides (its grader, its scripted policy)"),
    TaskField("split", False, "a string; ignored on replay: curation assigns the train / held-out split"),
)


def verifier_task_fields(env: Environment) -> list[TaskField]:
    """TASK_FIELDS told for `env`: `answer` by its answer_doc; `metadata` required and told by
    its metadata_doc when it has one."""
    def told(f: TaskField) -> TaskField:
        if f.name == "answer":
            return dataclasses.replace(f, text=env.answer_doc)
        if f.name == "metadata" and env.metadata_doc is not None:
            return dataclasses.replace(f, required=True, text=env.metadata_doc)
        return f
    return [told(f) for f in TASK_FIELDS]


def verifier_task_example(env: Environment) -> dict[str, Any]:
    """One real task of `env` (its `example_task`) as a verifier's task: its fields as JSON
    values, without `id` and `split` (curation sets both), `prompt` and `tools` (the trace's own
    are replayed) and fields left empty (no metadata)."""
    out = {k: v for k, v in dataclasses.asdict(env.example_task()).items()
           if k not in ("id", "split", "prompt", "tools")}
    return {k: v for k, v in out.items() if v is not None and v != {}}
