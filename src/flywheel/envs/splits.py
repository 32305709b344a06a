"""Train / test sides fixed by the problem itself, and the check that held-out tasks are held out.

A built-in environment with a generated or finite task space puts each problem on a side by a
hash of its canonical form (what makes two tasks one problem: calculator's expression with the
operands of + and * in a fixed order, arithmetic's prompt, reasoning_gym's question,
code_repair's buggy repository and problem statement), never by the random stream that drew
it. `side_of(key)` is "test" when the first 8 bytes of sha256(key), read as a fraction of
2**64, are below the test fraction (TEST_FRACTION, a fifth, unless the environment says
otherwise). A problem is then on one side under every setting, seed and count that can produce
it, so no draw from "train" can ever be a test problem. Each environment prefixes its keys
with its own name: the sides of two environments are independent.

`eval_overlap` counts the eval tasks whose problem (`Environment.problem_key`) is also a train
task's; `flywheel rl` runs it before training (train/rl.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Iterable

from flywheel.types import Task

TEST_FRACTION = 0.2
# Names the rule above; whatever caches data drawn from a side keys its cache by it
# (demo/base.py), so changing the rule means changing this name.
SPLIT_RULE = f"sha256-prefix-8B/test<{TEST_FRACTION}"


def split_score(key: str) -> float:
    """A uniform number in [0, 1) fixed by `key`: its sha256's first 8 bytes over 2**64."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2 ** 64


def side_of(key: str, test_fraction: float = TEST_FRACTION) -> str:
    """"test" when split_score(key) < test_fraction, else "train"."""
    if not 0.0 <= test_fraction <= 1.0:
        raise ValueError(f"test_fraction must be in [0, 1], got {test_fraction}")
    return "test" if split_score(key) < test_fraction else "train"


@dataclass(frozen=True)
class Overlap:
    """Eval tasks whose problem is also a train task's."""

    shared: int  # eval tasks that repeat a train problem
    total: int  # eval tasks checked
    example: tuple[str, str, str] | None = None  # (eval task id, train task id, problem key) of the first

    def __bool__(self) -> bool:
        return self.shared > 0

    @property
    def whole(self) -> bool:
        """Every eval task is a train problem (an evaluation on train tasks, not a leak into a held-out set)."""
        return self.total > 0 and self.shared == self.total

    def message(self) -> str:
        if not self.shared:
            return f"the {self.total} eval tasks share no problem with the train tasks"
        test_id, train_id, key = self.example
        shown = key if len(key) <= 120 else key[:117] + "..."
        return (f"{self.shared} of the {self.total} eval (test) tasks are also train tasks: the same problem, "
                f"e.g. eval task {test_id!r} and train task {train_id!r}: {shown!r}")


def eval_overlap(train: Iterable[Task], test: Iterable[Task], key: Callable[[Task], str]) -> Overlap:
    """How many `test` tasks share their problem (`key`) with a `train` task, and the first of them."""
    seen: dict[str, str] = {}
    for t in train:
        seen.setdefault(key(t), t.id)
    shared, total, example = 0, 0, None
    for t in test:
        total += 1
        k = key(t)
        if k in seen:
            shared += 1
            example = example or (t.id, seen[k], k)
    return Overlap(shared, total, example)
