"""The demo's first production model: a tiny model taught the week-1 family (add, with the calc
tool) by SFT on scripted episodes, built once and cached (first-time setup): a 64-hidden,
2-layer, 4-head model (with 4 heads the digit copying into and out of the tool call is
learnable in this budget; with 2 it was not).

It stands in for a pretrained model, so what it learns has to be the general skill: copy the
question's numbers into the call and the tool's result into the answer. Taught only 2-3 digit
additions, it learns a 4-digit result's leading "1" as a constant and later families stall;
so its demos mix additions of 1-2, 2-3 and 3-4 digit numbers (`digits`), which teaches it to
copy any 4-digit result. It never sees "minus" or "times". The probes behind these choices
are in docs/benchmarks.md ("Measurements behind choices in the code").
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from flywheel.demo.world import ENV, FAMILIES
from flywheel.envs.splits import SPLIT_RULE


@dataclass(frozen=True)
class BaseRecipe:
    """How the demo's base model is built: the tiny model's shape, its scripted SFT data and the
    SFT run. The hash of these fields names the model's cache folder (`key`)."""

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    ffn: int = 256
    demos: int = 4500  # scripted episodes of the week-1 family
    steps: int = 3000  # SFT steps
    batch: int = 16  # SFT batch size (no accumulation)
    lr: float = 3e-3
    warmup: int = 30
    family: dict[str, Any] = field(default_factory=lambda: FAMILIES[0].settings)  # calculator settings of the demos
    digits: tuple[int, ...] = (2, 3, 4)  # calculator max_digits of the demos, split evenly
    split_rule: str = SPLIT_RULE  # how the env puts a problem on train or test (envs/splits.py)

    def key(self) -> str:
        """12 hex digits of the SHA-256 of the fields as sorted JSON: the cache folder's name.
        A recipe that builds another model has another key; the same fields, the same key."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


BASE_RECIPE = BaseRecipe()


def cache_dir() -> Path:
    """$FLYWHEEL_CACHE, else ~/.cache/flywheel."""
    return Path(os.environ.get("FLYWHEEL_CACHE") or Path.home() / ".cache" / "flywheel")


def base_demos(final: Path) -> Path:
    """The SFT rows the base model at `final` (what base_model returned) was trained on."""
    return Path(final).parent.parent / "demos.jsonl"


def base_model(recipe: BaseRecipe | None = None, root: Path | None = None,
               log: Callable[[str], None] = print) -> Path:
    """The cached base model folder for `recipe` (default BASE_RECIPE), built if missing."""
    from flywheel.config import SFTConfig, validate
    from flywheel.models import TinySpec, build_tiny_model
    from flywheel.train.sft import run_sft

    recipe = recipe or BASE_RECIPE
    root = (root or cache_dir()) / f"demo-base-{recipe.key()}"
    final = root / "sft" / "final"
    if (final / "config.json").exists():
        return final
    log(f"first-time setup: building the demo's base model in {root} ({recipe.steps} SFT steps)")
    root.mkdir(parents=True, exist_ok=True)
    tiny = root / "tiny"
    if not (tiny / "config.json").exists():
        build_tiny_model(tiny, TinySpec(hidden=recipe.hidden, layers=recipe.layers, heads=recipe.heads,
                                        ffn=recipe.ffn))
    demos = root / "demos.jsonl"
    _addition_demos(recipe, demos)
    run_sft(validate(dict(model=str(tiny), output_dir=str(root / "sft"), resume=True,
                          data={"train": [str(demos)], "format": "chat"},
                          train={"steps": recipe.steps, "batch_size": recipe.batch, "micro_batch_size": recipe.batch},
                          optim={"lr": recipe.lr, "warmup_steps": recipe.warmup, "min_lr_ratio": 0.1,
                                 "weight_decay": 0.01},
                          checkpoint={"every": 250}, log={"progress": True}), SFTConfig), log=lambda m: None)
    return final


def _addition_demos(recipe: BaseRecipe, out: Path) -> None:
    """`recipe.demos` scripted episodes of the week-1 family, split evenly over the operand
    sizes in `recipe.digits` (calculator `max_digits`), as JSONL."""
    from flywheel.envs import load_env
    from flywheel.rollout.demos import make_demos

    sizes = recipe.digits
    rows: list[dict] = []
    for i, digits in enumerate(sizes):
        n = recipe.demos // len(sizes) + (i < recipe.demos % len(sizes))
        rows += make_demos(load_env(ENV, **{**recipe.family, "max_digits": digits}), n, seed=i)[0]
    random.Random(0).shuffle(rows)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
