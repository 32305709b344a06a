"""The shared bench task `ab+cd=`, exactly as ../shared/peers/trl_grpo_cpu/scripts/common.py
defines it: two-digit zero-padded operands, a fixed split of 200 held-out pairs (seed 1234)
never trained on, and reward 1 when the completion's leading number is the sum.

As an environment (`load(operators="+", digits=2)`, the defaults being the shared task) it
is single-turn and raw-completion: the prompt is the text `ab+cd=` with no chat template.
Other operators (+, -, *), digit counts and `heldout` sizes share one rule, so that no train
task is ever a test problem under any settings (`side_of_prompt`): a two-digit `ab+cd=` prompt
is on the side the peer split gives it, any other prompt on the side a hash of it gives
(envs/splits.py, a fifth test). The problems (all of them, or 20,000 drawn with a fixed seed in
larger spaces) go to train when on the train side; test holds the first `heldout` of those on
the test side, and the rest of the test side is used by neither.
"""

from __future__ import annotations

import functools
import json
import random
import re
from pathlib import Path
from typing import Iterable

from flywheel.envs.base import Env, Environment, Policy, check_split, sample_of
from flywheel.envs.rubric import Rubric, RewardFn
from flywheel.envs.splits import side_of
from flywheel.envs.tool_env import SingleTurnEnv
from flywheel.types import Task

N_HELDOUT = 200
SPLIT_SEED = 1234
_LEADING_NUMBER = re.compile(r"\s*(-?\d+)")  # the peer's r"\s*(\d+)" plus a sign for subtraction

Pair = tuple[int, int]


def all_pairs() -> list[Pair]:
    return [(a, b) for a in range(100) for b in range(100)]


def split_pairs() -> tuple[list[Pair], list[Pair]]:
    """(train pairs, 200 held-out pairs): the peer protocol's fixed split."""
    pairs = all_pairs()
    random.Random(SPLIT_SEED).shuffle(pairs)
    return pairs[N_HELDOUT:], pairs[:N_HELDOUT]


@functools.lru_cache(maxsize=1)
def _peer_test_prompts() -> frozenset[str]:
    return frozenset(prompt_of(a, b) for a, b in split_pairs()[1])


def side_of_prompt(prompt: str) -> str:
    """The split of a problem under every setting: for a two-digit sum ("12+34=") the peer
    split's, for any other prompt its hash's (envs/splits.py)."""
    if len(prompt) == 6 and prompt[2] == "+" and prompt[5] == "=" and (prompt[:2] + prompt[3:5]).isdigit():
        return "test" if prompt in _peer_test_prompts() else "train"
    return side_of("arithmetic\0" + prompt)


def prompt_of(a: int, b: int) -> str:
    return f"{a:02d}+{b:02d}="


def answer_of(a: int, b: int) -> str:
    return str(a + b)


def is_correct(completion: str, answer: str) -> bool:
    m = _LEADING_NUMBER.match(completion)
    return bool(m) and m.group(1) == answer


def reward(completion: str, answer: str) -> float:
    return 1.0 if is_correct(completion, answer) else 0.0


def sft_rows(pairs: Iterable[Pair]) -> list[dict]:
    """Prompt/completion rows (raw text, no chat template), e.g. {"prompt": "12+34=", "completion": "46"}."""
    return [{"prompt": prompt_of(a, b), "completion": answer_of(a, b)} for a, b in pairs]


def write_sft_jsonl(path: str | Path, pairs: Iterable[Pair]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in sft_rows(pairs)))
    return path


# ---------------------------------------------------------------- environment

OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class ArithmeticEnvironment(Environment):
    name = "arithmetic"
    answer_doc = ('the result as a JSON string of digits, e.g. "46" (a number never matches); a completion '
                  "scores 1 when its leading number is it")

    def __init__(self, operators: str = "+", digits: int = 2, heldout: int = N_HELDOUT):
        bad = [op for op in operators if op not in OPERATORS]
        if bad or not operators:
            raise ValueError(f"operators must be a non-empty string of {''.join(OPERATORS)}, got {operators!r}")
        if not 1 <= digits <= 6:
            raise ValueError(f"digits must be between 1 and 6, got {digits}")
        operators = "".join(dict.fromkeys(operators))  # "++" is "+"
        self.operators, self.digits, self.heldout = operators, digits, heldout
        self.shared = operators == "+" and digits == 2 and heldout == N_HELDOUT
        self._split: tuple[list[tuple], list[tuple]] | None = None
        self.description = ("the shared `ab+cd=` bench task (9,800 train / 200 held-out pairs)" if self.shared
                            else f"{digits}-digit arithmetic with {operators}")
        self.rubric = Rubric([RewardFn(lambda st: reward(st.final_text, st.task.answer), name="correct", inline=True)])

    def _problems(self) -> tuple[list[tuple], list[tuple]]:
        if self._split is None:
            self._split = self._make_split()
        return self._split

    def _make_split(self) -> tuple[list[tuple], list[tuple]]:
        if self.shared:
            train, test = split_pairs()
            return [(a, "+", b) for a, b in train], [(a, "+", b) for a, b in test]
        hi = 10 ** self.digits
        rng = random.Random(SPLIT_SEED)
        seen, problems = set(), []
        total = min(hi * hi * len(self.operators), 20_000)
        while len(problems) < total:
            p = (rng.randrange(hi), rng.choice(self.operators), rng.randrange(hi))
            if p not in seen:
                seen.add(p)
                problems.append(p)
        train, test = [], []
        for p in problems:
            (train if side_of_prompt(self._prompt(p)) == "train" else test).append(p)
        return train, test[:max(self.heldout, 0)]

    def _prompt(self, problem: tuple) -> str:
        a, op, b = problem
        return f"{a:0{self.digits}d}{op}{b:0{self.digits}d}="

    def tasks(self, split: str = "train", n: int | None = None, seed: int = 0) -> list[Task]:
        check_split(split)
        train, test = self._problems()
        chosen = train if split == "train" else test
        chosen = sample_of(chosen, n, seed)
        return [Task(id=self._prompt((a, op, b))[:-1], prompt=self._prompt((a, op, b)),
                     answer=str(OPERATORS[op](a, b)), split=split) for a, op, b in chosen]

    def make_env(self, task: Task) -> Env:
        return SingleTurnEnv(task, self.rubric)

    def scripted_policy(self) -> Policy:
        return _AnswerPolicy()

    def info(self) -> dict:
        train, test = self._problems()
        return {**super().info(), "operators": self.operators, "digits": self.digits,
                "train_tasks": len(train), "test_tasks": len(test), "reward": "1 if the leading number is right"}


class _AnswerPolicy(Policy):
    async def act(self, task, history, tools, episode: int = 0) -> str:
        return f"{task.answer}"


def load(operators: str = "+", digits: int = 2, heldout: int = N_HELDOUT) -> ArithmeticEnvironment:
    return ArithmeticEnvironment(operators=operators, digits=int(digits), heldout=int(heldout))
