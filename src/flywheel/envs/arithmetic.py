"""The shared bench task `ab+cd=`, exactly as ../shared/peers/trl_grpo_cpu/scripts/common.py
defines it: two-digit zero-padded operands, a fixed split of 200 held-out pairs (seed 1234)
never trained on, and reward 1 when the completion's leading number is the sum.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Iterable

N_HELDOUT = 200
SPLIT_SEED = 1234
_LEADING_NUMBER = re.compile(r"\s*(\d+)")

Pair = tuple[int, int]


def all_pairs() -> list[Pair]:
    return [(a, b) for a in range(100) for b in range(100)]


def split_pairs() -> tuple[list[Pair], list[Pair]]:
    """(train pairs, 200 held-out pairs): the peer protocol's fixed split."""
    pairs = all_pairs()
    random.Random(SPLIT_SEED).shuffle(pairs)
    return pairs[N_HELDOUT:], pairs[:N_HELDOUT]


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


def greedy_accuracy(engine, pairs: list[Pair], max_tokens: int = 6) -> tuple[float, list[tuple[str, str, bool]]]:
    """Held-out greedy accuracy with a Sampler; returns (accuracy, [(prompt, completion, ok)])."""
    from flywheel.inference import SamplingParams

    prompts = [engine.encode(prompt_of(a, b)) for a, b in pairs]
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    rows = []
    for (a, b), (sample,) in zip(pairs, out):
        rows.append((prompt_of(a, b), sample.text, is_correct(sample.text, answer_of(a, b))))
    return sum(ok for *_, ok in rows) / len(rows), rows


def heldout_accuracy(model, tokenizer) -> dict:
    """SFT evaluator hook (`eval.evaluator: flywheel.envs.arithmetic:heldout_accuracy`):
    greedy accuracy on the 200 held-out pairs, on a snapshot of the model."""
    import copy

    from flywheel.inference import LocalEngine

    engine = LocalEngine(copy.deepcopy(model), tokenizer)  # the engine fuses weights in place
    acc, _ = greedy_accuracy(engine, split_pairs()[1])
    return {"heldout_accuracy": acc}
