"""How flywheel's judge scores traces that no verifier grades, and how curation reads its scores.

The `curation.judge` section of a loop config (CurationConfig.judge). Curation reads a judge's
score with `fail_below` / `pass_at` below (curation_rules.verdict), a user's with curation's
own; the rest is what `flywheel traces judge` (loop/judging.py) runs with, its flags on top.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from flywheel.config import Config

JudgeMode = Literal["ranking", "rubric", "verdict"]

DEFAULT_RUBRIC = (
    "A good answer does what the user asked: it is correct, complete and uses the tools it was given properly. "
    "An answer that is wrong, off-topic, empty, or stops before the task is done is poor. "
    "Prefer a shorter answer only when both are equally correct.")


class JudgeConfig(Config):
    mode: JudgeMode = Field("ranking", description=(
        "ranking: the judge sees a group of answers to one prompt side by side and scores each relative to the "
        "others (RULER-style); rubric: each answer is scored alone against the rubric; verdict: each answer alone, "
        "the judge asked a yes/no question and the score read from its next-token probabilities, "
        "P(yes) / (P(yes) + P(no)), for judges too small to write JSON (no retry, `max_tokens` unused)"))
    rubric: str = Field(DEFAULT_RUBRIC, min_length=1, description="what a good answer is, as the judge is told")
    singletons: Literal["rubric", "skip"] = Field("rubric", description=(
        "in ranking mode, an answer that no other answer shares a prompt or opening with: scored alone "
        "against the rubric, or skipped (counted)"))
    max_group: int = Field(8, ge=2, le=32, description="answers per judge call; larger groups are split evenly")
    max_chars: int = Field(4000, ge=100, description="characters of one answer the judge sees (the middle is cut)")
    max_tokens: int = Field(256, ge=8, description="the judge's reply budget, in tokens")
    rejudge: bool = Field(False, description="judge again traces that already have judge feedback")
    fail_below: float = Field(0.5, ge=0, le=1, description="a judge score below this is a failure")
    pass_at: float = Field(0.7, ge=0, le=1, description=(
        "a judge score at or above this is a pass; a judge rarely gives 1.0, so this is below curation.pass_at"))

    @model_validator(mode="after")
    def _consistent(self) -> JudgeConfig:
        if self.fail_below > self.pass_at:
            raise ValueError(f"judge.fail_below ({self.fail_below}) must not exceed judge.pass_at ({self.pass_at})")
        return self
