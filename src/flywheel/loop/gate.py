"""The eval gate: does a candidate replace the incumbent?

Scores are accuracies in [0, 1] per named suite, measured for both models on the same tasks.
One suite is the held-out set of *new failures* (curated from production traces the
incumbent got wrong, never trained on); every other suite is a frozen *regression* suite.

    promote  <=>  new(candidate) - new(incumbent) >= delta
             and  for every regression suite s: s(candidate) >= s(incumbent) - epsilon

Missing or non-finite scores reject (a gate that cannot measure does not promote). Every
rule's outcome is written as a reason, passing ones too, so a decision explains itself in the
registry and the demo's table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from pydantic import Field

from flywheel.config import Config

NEW_FAILURES = "new_failures"


class GateConfig(Config):
    delta: float = Field(0.05, ge=0, le=1, description="min gain on the new-failure suite (0.05 = 5 points)")
    epsilon: float = Field(0.02, ge=0, le=1, description="max drop on any regression suite (0.02 = 2 points)")
    new_failures: str = Field(NEW_FAILURES, min_length=1, description="name of the new-failure suite")


@dataclass(frozen=True)
class GateDecision:
    promote: bool
    reasons: list[str]
    gain: float | None  # candidate - incumbent on the new-failure suite; None if unmeasured
    deltas: dict[str, float] = field(default_factory=dict)  # per suite, candidate - incumbent

    def summary(self) -> str:
        return ("promote: " if self.promote else "reject: ") + "; ".join(self.reasons)


def _points(x: float) -> str:
    return f"{100 * x:+.1f} pts"


def decide(incumbent: Mapping[str, float], candidate: Mapping[str, float], cfg: GateConfig = GateConfig()) -> GateDecision:
    """The gate rule above. `incumbent` and `candidate` map suite name -> accuracy in [0, 1]."""
    reasons: list[str] = []
    ok = True
    deltas: dict[str, float] = {}
    suites = sorted(set(incumbent) | set(candidate), key=lambda s: (s != cfg.new_failures, s))
    if cfg.new_failures not in suites:
        reasons.append(f"no '{cfg.new_failures}' suite was measured")
        ok = False
    for suite in suites:
        a, b = incumbent.get(suite), candidate.get(suite)
        if a is None or b is None:
            who = "incumbent" if a is None else "candidate"
            reasons.append(f"{suite}: no score for the {who}")
            ok = False
            continue
        if not (math.isfinite(a) and math.isfinite(b)):
            reasons.append(f"{suite}: non-finite score (incumbent {a}, candidate {b})")
            ok = False
            continue
        d = deltas[suite] = b - a
        if suite == cfg.new_failures:
            passed = d >= cfg.delta - 1e-12
            reasons.append(f"{suite} {a:.3f} -> {b:.3f} ({_points(d)}) "
                           f"{'>=' if passed else '<'} delta {_points(cfg.delta)[1:]}")
        else:
            passed = d >= -cfg.epsilon - 1e-12
            reasons.append(f"{suite} {a:.3f} -> {b:.3f} ({_points(d)})"
                           f"{'' if passed else f': drops more than epsilon {_points(cfg.epsilon)[1:]}'}")
        ok = ok and passed
    return GateDecision(ok, reasons, deltas.get(cfg.new_failures), deltas)
