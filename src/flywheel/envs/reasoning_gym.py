"""reasoning_gym: any of reasoning-gym's procedurally generated task families (leg counting,
arithmetic, letter counting, sudoku, ...) by name and settings, as a single-turn chat
environment: the system prompt asks for the final answer in <answer>...</answer>.

    load(dataset="leg_counting", size=1000, seed=0, scorer="exact", test_size=200, **settings)

`settings` go to `reasoning_gym.create_dataset`. A question's side is a hash of its text
(envs/splits.py, a fifth test), whatever the dataset's settings, seed or sizes, so no train
item is ever a test question, here or in an environment of other sizes: train is the first
`size` train-side items of the seed range (at most 2 x size + 16 generated), test the first
`test_size` distinct test-side items of its own range (`seed + TEST_SEED_OFFSET`, at most
10 x test_size + 50 generated); a small question space gives fewer (a split found empty is a
ValueError). Reward 1 (`correct`) by `scorer`: "exact" (default), whitespace- and case-normalised
equality with the gold answer, numbers compared by value; "native", the dataset's own
`score_answer`, for datasets with many valid answers (refused under "exact" at load). The
answer is the text of the last <answer> tag, else the last non-empty line. Weight-0 metric
`answer_format`: the reply holds a complete <answer>...</answer> pair.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from decimal import Decimal, InvalidOperation
from typing import Any

from flywheel.envs.base import Env, Environment, Policy, check_split, sample_of
from flywheel.envs.rubric import EpisodeState, RewardFn, Rubric
from flywheel.envs.splits import side_of
from flywheel.envs.tool_env import SingleTurnEnv
from flywheel.types import Task

SYSTEM = ("Solve the problem. You may reason briefly first, then give only the final answer "
          "inside <answer>...</answer> tags, e.g. <answer>42</answer>.")
# "exact" is the default because reasoning-gym's base scorer (most datasets') gives partial credit
# len(gold) / len(reply) whenever the gold answer is a substring of the reply: for gold "500" the
# hedge "500 or 502" earns 0.3, so under RL a policy learns to list guesses instead of the task.
SCORERS = ("exact", "native")
TEST_SEED_OFFSET = 1_000_000_007  # test items use seeds far from the train ones (Random(seed + idx))
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")


# ---------------------------------------------------------------- answers


def extract_answer(text: str) -> str | None:
    """The text inside the last <answer>...</answer>, else the last non-empty line, else None."""
    found = _ANSWER.findall(text)
    if found:
        return found[-1].strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


def has_answer_tags(text: str) -> bool:
    return _ANSWER.search(text) is not None


def normalize(text: str) -> str:
    return " ".join(text.split()).casefold()


def _as_number(text: str) -> Decimal | None:
    if not _NUMBER.fullmatch(text):
        return None
    try:
        return Decimal(text)
    except InvalidOperation:  # pragma: no cover - the regex admits only valid literals
        return None


def exact_match(answer: str | None, gold: Any) -> bool:
    """Normalised equality; numbers compared by value ("3.0" == "3", "-0" == "0")."""
    if answer is None or gold is None:
        return False
    a, g = normalize(answer), normalize(str(gold))
    na, ng = _as_number(a), _as_number(g)
    if na is not None and ng is not None:
        return na == ng
    return a == g


# ---------------------------------------------------------------- environment


def _datasets() -> dict:
    from reasoning_gym.factory import DATASETS  # an extra (flywheel[envs]): imported on use

    return DATASETS


def _create(dataset: str, seed: int, size: int, settings: dict):
    """reasoning_gym.create_dataset with every failure turned into a ValueError naming the dataset."""
    import reasoning_gym

    registry = _datasets()
    if dataset not in registry:
        close = difflib.get_close_matches(dataset, registry, n=3, cutoff=0.5)
        examples = close + [n for n in ("leg_counting", "basic_arithmetic", "letter_counting", "chain_sum",
                                        "spell_backward", "gsm_symbolic") if n not in close]
        raise ValueError(f"unknown reasoning-gym dataset {dataset!r}"
                         + (f" (did you mean {', '.join(close)}?)" if close else "")
                         + f"; valid names include {', '.join(examples[:6])} ({len(registry)} in all)")
    fields = [f.name for f in dataclasses.fields(registry[dataset][1]) if f.name not in ("seed", "size")]
    unknown = sorted(set(settings) - set(fields))
    if unknown:
        raise ValueError(f"reasoning-gym dataset {dataset!r}: unknown setting(s) {', '.join(unknown)}; "
                         f"its settings are {', '.join(fields) or 'none'}")
    try:
        ds = reasoning_gym.create_dataset(dataset, seed=seed, size=size, **settings)
        probe = ds[0]  # some bad settings only fail when an item is generated
    except Exception as e:  # AssertionError from validate(), TypeError / ValueError from generation
        raise ValueError(f"reasoning-gym dataset {dataset!r}: bad settings {settings}: "
                         f"{type(e).__name__}: {e}") from None
    return ds, probe


def side_of_question(question: str) -> str:
    """The split ("train" / "test") of a question, under every dataset setting and size."""
    return side_of("reasoning_gym\0" + question)


class ReasoningGymEnvironment(Environment):
    answer_doc = ("the gold answer (a string): the reply's last <answer>...</answer> (else its last line) must "
                  "equal it, whitespace and case normalised, numbers compared by value")

    def __init__(self, dataset: str = "leg_counting", size: int = 1000, seed: int = 0, scorer: str = "exact",
                 test_size: int = 200, settings: dict[str, Any] | None = None):
        if scorer not in SCORERS:
            raise ValueError(f"scorer must be one of {', '.join(SCORERS)}, got {scorer!r}")
        if size < 1 or test_size < 1:
            raise ValueError(f"size and test_size must be >= 1, got size={size}, test_size={test_size}")
        self.dataset, self.size, self.seed, self.scorer, self.test_size = dataset, size, seed, scorer, test_size
        self.settings = dict(settings or {})
        self.name = "reasoning_gym"
        self.description = f"reasoning-gym {dataset!r}: single-turn, answer in <answer> tags, {scorer} scoring"
        # both generated with room to spare: the items of the other side are skipped
        self._train_ds, probe = _create(dataset, seed, 2 * size + 16, self.settings)
        self._test_ds, _ = _create(dataset, seed + TEST_SEED_OFFSET, 10 * test_size + 50, self.settings)
        if scorer == "exact" and probe.get("answer") is None:
            raise ValueError(f"reasoning-gym dataset {dataset!r} has no single gold answer (it accepts many); "
                             "use scorer=native")
        self._splits: tuple[list[Task], list[Task]] | None = None
        correct = self._native if scorer == "native" else self._exact
        self.rubric = Rubric([
            RewardFn(correct, weight=1.0, name="correct", inline=scorer == "exact"),
            RewardFn(lambda st: float(has_answer_tags(st.final_text)), weight=0.0, name="answer_format",
                     inline=True)])

    # -- scoring

    @staticmethod
    def _exact(st: EpisodeState) -> float:
        return float(exact_match(extract_answer(st.final_text), st.task.answer))

    def _native(self, st: EpisodeState) -> float:
        try:
            return float(self._train_ds.score_answer(extract_answer(st.final_text), st.task.metadata["entry"]))
        except Exception:  # a dataset scorer choking on odd model output is a wrong answer, not a crash
            return 0.0

    # -- tasks

    def _task(self, entry: dict, split: str, index: int) -> Task:
        answer = entry.get("answer")
        return Task(id=f"rg-{self.dataset}-{split}-{index}", split=split,
                    answer=None if answer is None else str(answer),
                    prompt=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": entry["question"]}],
                    metadata={"dataset": self.dataset, "entry": entry})

    def splits(self) -> tuple[list[Task], list[Task]]:
        """(train, test), generated on first use (module docstring)."""
        if self._splits is None:
            train = []
            for i in range(len(self._train_ds)):
                if len(train) == self.size:
                    break
                entry = self._train_ds[i]
                if side_of_question(entry["question"]) == "train":
                    train.append(self._task(entry, "train", i))
            seen, test = set(), []
            for i in range(len(self._test_ds)):
                if len(test) == self.test_size:
                    break
                entry = self._test_ds[i]
                if entry["question"] in seen or side_of_question(entry["question"]) != "test":
                    continue
                seen.add(entry["question"])
                test.append(self._task(entry, "test", i))
            for name, tasks, tried in (("train", train, len(self._train_ds)), ("test", test, len(self._test_ds))):
                if not tasks:
                    raise ValueError(f"reasoning-gym dataset {self.dataset!r} with settings {self.settings}: none of "
                                     f"{tried} generated items is a {name} question (too few distinct questions)")
            self._splits = train, test
        return self._splits

    def tasks(self, split: str = "train", n: int | None = None, seed: int = 0) -> list[Task]:
        check_split(split)
        train, test = self.splits()
        chosen = train if split == "train" else test
        chosen = sample_of(chosen, n, seed)
        return list(chosen)

    def make_env(self, task: Task) -> Env:
        return SingleTurnEnv(task, self.rubric)

    def scripted_policy(self) -> Policy:
        return GoldAnswerPolicy()

    def info(self) -> dict:
        train, test = self.splits()
        return {**super().info(), "dataset": self.dataset, "settings": self.settings, "seed": self.seed,
                "scorer": self.scorer, "train_tasks": len(train), "test_tasks": len(test),
                "reward": ("1 if the <answer> equals the gold answer (numbers by value)" if self.scorer == "exact"
                           else "the dataset's own score_answer"),
                "metrics": ["answer_format (weight 0)"]}


class GoldAnswerPolicy(Policy):
    """Answers with the gold answer in tags."""

    async def act(self, task, history, tools, episode: int = 0) -> str:
        return f"<answer>{task.answer}</answer>"


def load(dataset: str = "leg_counting", size: int = 1000, seed: int = 0, scorer: str = "exact",
         test_size: int = 200, **settings: Any) -> ReasoningGymEnvironment:
    return ReasoningGymEnvironment(dataset=str(dataset), size=int(size), seed=int(seed), scorer=str(scorer),
                                   test_size=int(test_size), settings=settings)
