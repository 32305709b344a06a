"""The eval gate: does a candidate replace the incumbent?

Both models are measured on the same tasks, suite by suite, as per-task outcomes (pass/fail
per task, `paired.Outcomes`); a suite given as a bare accuracy in [0, 1] is compared by point
estimate only. One suite is the held-out set of *new failures* (curated from production
traces the incumbent got wrong, never trained on); every other suite is a frozen
*regression* suite. With d_i = cand_i - inc_i per task, mean(d) the difference of the
accuracies, and LB / UB its lower / upper bound at `confidence` (the exact paired bootstrap,
paired.py):

    promote  <=>  n(new failures) >= min_new_failures
             and  LB(new failures) >= delta                       (a gain, with confidence)
             and  for every regression suite s:
                    mean(d_s) >= -epsilon and UB(d_s) >= -epsilon  (no drop beyond epsilon;
                                                                    the UB term is implied by
                                                                    the first, checked anyway)
                    and the same against best(s), the best score any promoted version (or
                    the base) reached on s, where that is above the incumbent's

The rule against best(s) is what stops drift from adding up: three candidates each within
epsilon of their incumbent can together fall 3 epsilon below where production once was; each
must stay within epsilon of the best too. best(s) is compared task by task where its
outcomes on the same task ids are known (same digest), else by point estimate. The caller
looks the best scores up (the registry's records) and passes them in: decide() is a pure
function of its arguments.

Missing or non-finite scores reject, and so do new failures without per-task outcomes (a gate
that cannot measure does not promote). Every rule's outcome is written as a reason, passing
ones too, so a decision explains itself in the registry and the demo's table, e.g.
`new_failures 0.000 -> 0.429 (+42.9 pts, 95% lower bound +14.3 pts; 3 gained, 0 lost of 7
tasks) >= delta 5.0 pts`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Union

from pydantic import Field

from flywheel.config import Config
from flywheel.loop.paired import Outcomes, Paired, pair

NEW_FAILURES = "new_failures"
Score = Union[float, Outcomes]  # per-task outcomes, or an accuracy alone (point estimate)


class GateConfig(Config):
    delta: float = Field(0.05, ge=0, le=1, description=(
        "min gain on the new-failure suite (0.05 = 5 points), which its lower confidence bound must clear"))
    epsilon: float = Field(0.02, ge=0, le=1, description=(
        "max drop on any regression suite (0.02 = 2 points), against the incumbent and against the best "
        "score a promoted version reached on it"))
    confidence: float = Field(0.95, ge=0.5, lt=1, description=(
        "confidence of the bounds (exact paired bootstrap): the gain's lower bound must clear delta, "
        "a regression's upper bound is reported"))
    min_new_failures: int = Field(20, ge=1, description=(
        "held-out new failures a cycle needs to decide; with fewer it trains nothing and waits for more "
        "traffic. At 20 one task is 5 points, as coarse as delta's default: the smallest gain that clears "
        "it at 95% is 3 of 20 gained, none lost"))
    new_failures: str = Field(NEW_FAILURES, min_length=1, description="name of the new-failure suite")


@dataclass(frozen=True)
class Best:
    """The best score a promoted version (or the base) reached on one frozen suite."""

    version: str
    score: Score


@dataclass(frozen=True)
class GateDecision:
    promote: bool
    reasons: list[str]
    gain: float | None  # candidate - incumbent on the new-failure suite; None if unmeasured
    deltas: dict[str, float] = field(default_factory=dict)  # per suite, candidate - incumbent
    bounds: dict[str, float] = field(default_factory=dict)  # new failures: lower bound; regression: upper
    below_best: dict[str, float] = field(default_factory=dict)  # per suite where best > incumbent: cand - best

    def summary(self) -> str:
        return ("promote: " if self.promote else "reject: ") + "; ".join(self.reasons)


def _points(x: float, digits: int = 1) -> str:
    return f"{100 * x:+.{digits}f} pts"


def telling_digits(a: float, b: float, most: int = 6) -> int:
    """Decimals (1 to `most`) that tell two fractions apart in points: the fewest at which
    `100 a` and `100 b` print differently, so that a reason never reads "+5.0 pts < 5.0 pts".
    telling_digits(0.0496, 0.05) == 2 ("+4.96" vs "5.00"); equal values: 1."""
    for d in range(1, most + 1):
        if f"{100 * a:.{d}f}" != f"{100 * b:.{d}f}":
            return d
    return 1


def _accuracy(s: Score) -> float:
    return s.accuracy if isinstance(s, Outcomes) else float(s)


def too_few(n: int, cfg: GateConfig) -> str | None:
    """The reason a cycle with `n` held-out new failures cannot decide, or None."""
    return f"too few new failures to decide: {n} < {cfg.min_new_failures}" if n < cfg.min_new_failures else None


def _paired(ref: Score, cand: Score) -> Paired | None | str:
    """The paired comparison, None when one side is an accuracy alone, or why not (a string)."""
    if not (isinstance(ref, Outcomes) and isinstance(cand, Outcomes)):
        return None
    try:
        return pair(ref, cand)
    except ValueError as e:
        return str(e)


def decide(incumbent: Mapping[str, Score], candidate: Mapping[str, Score], cfg: GateConfig = GateConfig(), *,
           best: Mapping[str, Best] | None = None) -> GateDecision:
    """The gate rule above. `incumbent` and `candidate` map suite name -> per-task Outcomes
    (or an accuracy in [0, 1]); `best`: regression suite -> the best promoted score on it."""
    reasons: list[str] = []
    ok = True
    deltas: dict[str, float] = {}
    bounds: dict[str, float] = {}
    below_best: dict[str, float] = {}
    conf = f"{100 * cfg.confidence:g}%"
    suites = sorted(set(incumbent) | set(candidate), key=lambda s: (s != cfg.new_failures, s))
    if cfg.new_failures not in suites:
        reasons.append(f"no '{cfg.new_failures}' suite was measured")
        ok = False
    for suite in suites:
        inc, cand = incumbent.get(suite), candidate.get(suite)
        if inc is None or cand is None:
            reasons.append(f"{suite}: no score for the {'incumbent' if inc is None else 'candidate'}")
            ok = False
            continue
        a, b = _accuracy(inc), _accuracy(cand)
        if not (math.isfinite(a) and math.isfinite(b)):
            reasons.append(f"{suite}: non-finite score (incumbent {a}, candidate {b})")
            ok = False
            continue
        d = deltas[suite] = b - a
        p = _paired(inc, cand)
        if isinstance(p, str):
            reasons.append(f"{suite}: incumbent and candidate were not scored on the same tasks: {p}")
            ok = False
            continue
        if suite == cfg.new_failures:
            passed, why = _gain(suite, a, b, p, cfg, conf, bounds)
            reasons.append(why)
        else:
            passed, why = _no_drop(suite, f"{suite} {a:.3f}", b, d, p, cfg, conf, bounds, "")
            reasons.append(why)
            ref = (best or {}).get(suite)
            if ref is not None and math.isfinite(_accuracy(ref.score)) and _accuracy(ref.score) > a + 1e-12:
                passed = _below_best(suite, ref, cand, b, cfg, conf, below_best, reasons) and passed
        ok = ok and passed
    return GateDecision(ok, reasons, deltas.get(cfg.new_failures), deltas, bounds, below_best)


def _gain(suite: str, a: float, b: float, p: Paired | None, cfg: GateConfig, conf: str,
          bounds: dict[str, float]) -> tuple[bool, str]:
    if p is None:
        return False, f"{suite}: no per-task outcomes; the gain's confidence bound needs them"
    few = too_few(p.n, cfg)
    if few:
        return False, f"{few} ({suite} {a:.3f} -> {b:.3f})"
    lower = bounds[suite] = p.lower(cfg.confidence)
    passed = lower >= cfg.delta - 1e-12
    digits = telling_digits(lower, cfg.delta) if not passed else 1  # a failed bound reads as below delta
    return passed, (f"{suite} {a:.3f} -> {b:.3f} ({_points(p.mean)}, {conf} lower bound {_points(lower, digits)}; "
                    f"{p.counts()}) {'>=' if passed else '<'} delta {_points(cfg.delta, digits)[1:]}")


def _no_drop(suite: str, before: str, b: float, d: float, p: Paired | None, cfg: GateConfig, conf: str,
             bounds: dict[str, float], below: str) -> tuple[bool, str]:
    """The regression rule for a drop `d` (paired `p` when known): a reason `before -> b (...)`."""
    upper = None if p is None else p.upper(cfg.confidence)
    if upper is not None and not below:
        bounds[suite] = upper
    worst = d if upper is None else min(d, upper)
    passed = worst >= -cfg.epsilon - 1e-12
    digits = 1 if passed else telling_digits(worst, -cfg.epsilon)  # a drop reads as beyond epsilon
    if upper is None:
        detail = f"{_points(d, digits)}" + (", point estimate" if below else "")
    else:
        detail = f"{_points(d, digits)}, {conf} upper bound {_points(upper, digits)}; {p.counts()}"
    return passed, (f"{before} -> {b:.3f} ({detail})"
                    + ("" if passed else f": drops more than epsilon {_points(cfg.epsilon, digits)[1:]}{below}"))


def _below_best(suite: str, ref: Best, cand: Score, b: float, cfg: GateConfig, conf: str,
                below_best: dict[str, float], reasons: list[str]) -> bool:
    """The regression rule against the best promoted score; appends its reason."""
    p = _paired(ref.score, cand)
    if isinstance(p, str):  # other tasks than the candidate's: only the accuracies compare
        p = None
    d = below_best[suite] = b - _accuracy(ref.score)
    passed, why = _no_drop(suite, f"{suite} best {_accuracy(ref.score):.3f} ({ref.version})", b, d, p, cfg, conf,
                           {}, " below the best promoted score")
    reasons.append(why)
    return passed
