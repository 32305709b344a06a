"""Feedback judged when it arrives, by the rules curation will apply later, so a client hears
at once (a 400 naming the field) what curation would otherwise drop in silence:
- a label must be one of the configured failure or success labels (stripped, any case);
- a verifier must name a built-in environment or one listed in `curation.environments`, and
  its task must be a Task (envs/replay.py's `task_from_dict`; `prompt` optional, since the
  trace's own prompt is what is replayed) with an answer to grade against.
"""

from __future__ import annotations

from typing import Any

from flywheel.envs.registry import list_envs
from flywheel.envs.replay import task_from_dict
from flywheel.loop.curation_rules import CurationConfig


class FeedbackRefused(ValueError):
    """`field` (a dotted path into the feedback body) is why the feedback is refused."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def trusted_env(name: str, cfg: CurationConfig) -> bool:
    """Verifiers come from clients and replaying one runs its environment's loader: only the
    built-ins and what the operator listed in `curation.environments` are replayed."""
    return name != "replay" and (name in list_envs() or name in cfg.environments)


def check_feedback(body: dict[str, Any], cfg: CurationConfig) -> None:
    """Raise FeedbackRefused when curation could not use this feedback as sent. Fields of the
    wrong type are left to the store's validation, which names them."""
    label = body.get("label")
    if isinstance(label, str):
        known = sorted({x.strip().lower() for x in (*cfg.failure_labels, *cfg.success_labels)})
        if label.strip().lower() not in known:
            raise FeedbackRefused("label", f"unknown label {label!r}; one of {', '.join(known)} "
                                           "(curation.failure_labels / success_labels)")
    verifier = body.get("verifier")
    if not isinstance(verifier, dict):
        return
    env = verifier.get("env")
    if isinstance(env, str) and not trusted_env(env, cfg):
        raise FeedbackRefused("verifier.env", f"{env!r} is neither a built-in environment "
                                              f"({', '.join(n for n in list_envs() if trusted_env(n, cfg))}) "
                                              "nor listed in curation.environments")
    if "task" in verifier:
        try:
            # the prompt may be left out: curation replays the trace's own, as served
            task = task_from_dict(verifier["task"], default_id="feedback", default_prompt="(the trace's prompt)")
        except ValueError as e:
            raise FeedbackRefused("verifier.task", str(e)) from None
        if task.answer is None:
            raise FeedbackRefused("verifier.task.answer", "a verifier's task needs the answer to grade against")
