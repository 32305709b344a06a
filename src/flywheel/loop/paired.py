"""Paired per-task outcomes and the confidence bound the gate reads from them.

Both models of a cycle play the same tasks, so the evidence is one pair per task: the
incumbent passed or failed it, the candidate passed or failed it. `Outcomes` is one model's
pass/fail per task, in the suite's task order, with `tasks`, a digest of the ordered task ids
(two Outcomes are comparable task by task exactly when their digests agree). Stored as a
record, one bit per task: {"tasks": digest, "n": 7, "passed": "e0"} (hex, first task in the
highest bit, padded with zeros to whole hex digits).

The statistic is the mean paired difference d_i = cand_i - inc_i in {-1, 0, +1}: with `g`
tasks gained (+1), `l` lost (-1) and `n - g - l` unchanged, its mean is (g - l) / n, the
difference of the two accuracies.

The bound: the exact bootstrap of that mean. Resampling the n pairs with replacement draws
n of the differences, so the resample's counts of +1 / 0 / -1 are Multinomial(n; g/n,
(n-g-l)/n, l/n), and its sum S* = (#+1) - (#-1) takes each value s in -n..n with probability

    P(S* = s) = the coefficient of x^(s+n) in (l/n + (n-g-l)/n x + g/n x^2)^n

No random sampling: the distribution is computed exactly (up to float rounding), so a bound
is deterministic and can be worked by hand. At confidence c (alpha = 1 - c):

    lower bound  = min{ s : P(S* <= s) >= alpha } / n          (the alpha quantile)
    upper bound  = max{ s : P(S* >= s) >= alpha } / n  = -lower bound with g and l swapped

Worked example: 7 new failures, the incumbent fails all, the candidate passes 3 (g=3, l=0).
S* ~ Binomial(7, 3/7): P(S* = 0) = (4/7)^7 = 0.0199 < 0.05, P(S* <= 1) = 0.0199 + 7 (3/7)
(4/7)^6 = 0.1244 >= 0.05, so the 95% lower bound is 1/7 = +14.3 points (the point gain is
3/7 = +42.9). Another: n = 3 with one task gained and one lost is the sum of three uniform
draws from {-1, 0, 1}, whose 27 outcomes give S* = -3..3 with counts 1 3 6 7 6 3 1, so the
95% lower bound is -2/3 (P(S* <= -3) = 1/27 < 0.05 <= P(S* <= -2) = 4/27).

How it departs from the textbook: the usual bootstrap samples B resamples at random; here
the B -> infinity limit is computed outright. The coefficients of the trinomial power come
from J. C. P. Miller's recurrence for the powers of a polynomial (from f' P = n P' f for
f = P^n, P = c + b x + a x^2):

    f_m = [b (n - m + 1) f_{m-1} + a (2n - m + 2) f_{m-2}] / (c m),   f_0 = c^n

O(n) for every n, in log space (no underflow at any n). Run from the -1 end for m <= n and
from the +1 end (the reversed polynomial) for the other half, every term is positive, so there
is no cancellation. As any percentile bootstrap it is approximate coverage, not a guarantee,
and it is poor for a handful of tasks: the gate asks for `min_new_failures` of them.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

_INF = float("-inf")


@dataclass(frozen=True)
class Outcomes:
    """One model's pass/fail on each task of a suite, in the suite's task order."""

    tasks: str  # digest of the ordered task ids: Outcomes pair up iff their digests agree
    passed: tuple[bool, ...]

    @classmethod
    def of(cls, ids: Sequence[str], passed: Sequence[bool]) -> Outcomes:
        if len(ids) != len(passed):
            raise ValueError(f"{len(ids)} task ids for {len(passed)} outcomes")
        return cls(task_digest(ids), tuple(bool(p) for p in passed))

    @property
    def n(self) -> int:
        return len(self.passed)

    @property
    def accuracy(self) -> float:
        return sum(self.passed) / self.n if self.passed else math.nan

    def record(self) -> dict[str, Any]:
        """{"tasks", "n", "passed"}: one bit per task, as hex (first task in the highest bit)."""
        bits = "".join("1" if p else "0" for p in self.passed)
        bits += "0" * (-len(bits) % 4)
        hexed = "".join(f"{int(bits[i:i + 4], 2):x}" for i in range(0, len(bits), 4))
        return {"tasks": self.tasks, "n": self.n, "passed": hexed}

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> Outcomes:
        n, hexed = int(rec["n"]), str(rec["passed"])
        if len(hexed) != (n + 3) // 4:
            raise ValueError(f"outcome record of {n} tasks has {len(hexed)} hex digits")
        bits = "".join(f"{int(h, 16):04b}" for h in hexed)[:n]
        return cls(str(rec["tasks"]), tuple(b == "1" for b in bits))


def task_digest(ids: Sequence[str]) -> str:
    """16 hex digits of SHA-256 over the ordered ids (newline-joined)."""
    return hashlib.sha256("\n".join(map(str, ids)).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Paired:
    """The paired comparison of two Outcomes on the same tasks (`cand` against `ref`)."""

    n: int
    gained: int  # tasks the candidate passes and the reference fails
    lost: int  # tasks the reference passes and the candidate fails

    @property
    def mean(self) -> float:
        """Mean of d_i = cand_i - ref_i: the difference of the two accuracies."""
        return (self.gained - self.lost) / self.n

    def lower(self, confidence: float) -> float:
        return lower_bound(self.gained, self.lost, self.n, confidence)

    def upper(self, confidence: float) -> float:
        return upper_bound(self.gained, self.lost, self.n, confidence)

    def counts(self) -> str:
        return f"{self.gained} gained, {self.lost} lost of {self.n} tasks"


def pair(ref: Outcomes, cand: Outcomes) -> Paired:
    """`cand` against `ref`, task by task; ValueError unless both scored the same tasks."""
    if ref.tasks != cand.tasks or ref.n != cand.n:
        raise ValueError(f"not the same tasks ({ref.n} tasks {ref.tasks} vs {cand.n} tasks {cand.tasks})")
    if ref.n == 0:
        raise ValueError("no tasks to pair")
    gained = sum(c and not r for r, c in zip(ref.passed, cand.passed))
    lost = sum(r and not c for r, c in zip(ref.passed, cand.passed))
    return Paired(ref.n, gained, lost)


# ---------------------------------------------------------------- the exact bootstrap


def _logaddexp(x: float, y: float) -> float:
    if x == _INF:
        return y
    if y == _INF:
        return x
    hi, lo = (x, y) if x >= y else (y, x)
    return hi + math.log1p(math.exp(lo - hi))


def _log(x: float) -> float:
    return math.log(x) if x > 0 else _INF


def _half(c: float, b: float, a: float, n: int) -> list[float]:
    """log f_0 .. log f_n for (c + b x + a x^2)^n, c > 0 (Miller's recurrence; all terms >= 0
    for m <= n)."""
    lc, lb, la = math.log(c), _log(b), _log(a)
    out = [n * lc]
    for m in range(1, n + 1):
        t1 = lb + math.log(n - m + 1) + out[m - 1] if lb != _INF else _INF
        t2 = la + math.log(2 * n - m + 2) + out[m - 2] if m >= 2 and la != _INF else _INF
        out.append(_logaddexp(t1, t2) - lc - math.log(m))
    return out


def bootstrap_pmf(gained: int, lost: int, n: int) -> list[float]:
    """P(S* = s) for s = -n .. n (list index s + n): the exact bootstrap distribution of the
    sum of n paired differences resampled from `gained` +1s, `lost` -1s and the rest 0s."""
    if n < 1 or gained < 0 or lost < 0 or gained + lost > n:
        raise ValueError(f"need 0 <= gained, lost and gained + lost <= n >= 1 (gained {gained}, lost {lost}, n {n})")
    a, b, c = gained / n, (n - gained - lost) / n, lost / n
    logs = [_INF] * (2 * n + 1)
    if c > 0:  # S* <= 0 from the -1 end: index m = s + n
        logs[:n + 1] = _half(c, b, a, n)
    if a > 0:  # S* >= 0 from the +1 end: index 2n - k; index n (S* = 0) is computed by both
        for k, v in enumerate(_half(a, b, c, n)):
            if c == 0 or k < n:
                logs[2 * n - k] = v
    if a == 0 and c == 0:
        logs[n] = 0.0  # every difference is 0
    return [math.exp(v) if v != _INF else 0.0 for v in logs]


def lower_bound(gained: int, lost: int, n: int, confidence: float) -> float:
    """The lower `confidence` bound on the mean paired difference: the (1 - confidence)
    quantile of the exact bootstrap, min{s : P(S* <= s) >= 1 - confidence} / n."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    alpha, total = 1.0 - confidence, 0.0
    pmf = bootstrap_pmf(gained, lost, n)
    for i, p in enumerate(pmf):
        total += p
        if total >= alpha - 1e-12:  # float sums at an exact tie count as reaching it
            return (i - n) / n
    return 1.0  # only by rounding: the pmf sums to 1


def upper_bound(gained: int, lost: int, n: int, confidence: float) -> float:
    """The upper `confidence` bound: max{s : P(S* >= s) >= 1 - confidence} / n, the mirror of
    `lower_bound` (a gained task read as a lost one)."""
    return -lower_bound(lost, gained, n, confidence) + 0.0  # + 0.0: no -0.0
