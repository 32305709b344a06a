"""The best score each frozen suite reached in production: no candidate may fall more than
epsilon below it (gate.py), so drift cannot add up over cycles.

A cycle registers its candidate with both models' scores (cycle._finish):

    eval_scores = {"incumbent": {suite: accuracy}, "candidate": {suite: accuracy},
                   "outcomes": {"incumbent": {suite: record}, "candidate": {suite: record}}}

(`record`: paired.Outcomes.record, one bit per task). So the registry holds a measurement of
every candidate and of every incumbent, the base model's too as the first cycle's incumbent.
`best_scores` picks, per suite, the highest of those measurements of a version that was ever
in production (promoted or rolled back to). A measurement with outcomes on other task ids
than this cycle's (the suite was redefined since) measures other tasks and is left out; one
without outcomes (registered before they were kept) counts by its accuracy alone.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from flywheel.loop.gate import Best, Score
from flywheel.loop.paired import Outcomes

ROLES = ("incumbent", "candidate")


def measurements(version: str, parent: str | None, eval_scores: Mapping[str, Any]):
    """(measured version, suite, score) for each score a version's record holds: its own as
    the candidate, its parent's as the incumbent. A score is Outcomes where a valid record of
    the same accuracy is stored, else the accuracy."""
    records = eval_scores.get("outcomes") if isinstance(eval_scores.get("outcomes"), dict) else {}
    for role, who in (("candidate", version), ("incumbent", parent)):
        scores = eval_scores.get(role)
        if who is None or not isinstance(scores, dict):
            continue
        for suite, acc in scores.items():
            if not isinstance(acc, (int, float)) or isinstance(acc, bool):
                continue
            score: Score = float(acc)
            rec = (records.get(role) or {}).get(suite) if isinstance(records.get(role), dict) else None
            if isinstance(rec, dict):
                try:
                    outcomes = Outcomes.from_record(rec)
                    if outcomes.n and abs(outcomes.accuracy - acc) < 1e-9:
                        score = outcomes
                except (KeyError, TypeError, ValueError):
                    pass  # an unreadable record: the accuracy still counts
            yield who, suite, score


def best_scores(records: Iterable[tuple[str, str | None, Mapping[str, Any]]], promoted: set[str],
                digests: Mapping[str, str | None]) -> dict[str, Best]:
    """Per suite of `digests` (suite -> this cycle's task digest, None if unknown), the best
    measurement of a `promoted` version among `records` (version, parent, eval_scores), in
    registration order. Ties go to a measurement on the same tasks (it pairs), then to the
    earliest."""
    best: dict[str, tuple[tuple[float, bool], Best]] = {}
    for version, parent, eval_scores in records:
        for who, suite, score in measurements(version, parent, eval_scores):
            if who not in promoted or suite not in digests:
                continue
            same = isinstance(score, Outcomes) and score.tasks == digests[suite]
            if isinstance(score, Outcomes) and not same:
                continue  # other tasks than the suite's now
            acc = score.accuracy if isinstance(score, Outcomes) else score
            key = (acc, same)
            if suite not in best or key > best[suite][0]:
                best[suite] = (key, Best(who, score))
    return {suite: b for suite, (_, b) in best.items()}


def best_promoted(registry, digests: Mapping[str, str | None]) -> dict[str, Best]:
    """`best_scores` over a Registry's versions and the versions its history put in production."""
    promoted = {e.version for e in registry.history() if e.action in ("promote", "rollback")}
    return best_scores(((v.id, v.parent, v.eval_scores) for v in registry.list()), promoted, digests)
