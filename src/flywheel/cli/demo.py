"""`flywheel demo` (and `python -m flywheel.demo`): the flagship demo (flywheel.demo.run); its
defaults are the demo's own (DemoRecipe, WorldConfig)."""

from __future__ import annotations

from pathlib import Path

import typer

from flywheel.cli.threads import set_threads, threads_option
from flywheel.demo.run import DEMO_RECIPE, DemoRecipe, run_demo, summary_lines
from flywheel.demo.world import WorldConfig

_W = WorldConfig()


def demo(out: Path = typer.Option(Path("flywheel-data/demo"), help="the demo's data dir (recreated)"),
         weeks: int = typer.Option(_W.weeks, min=1, max=3),
         days: int = typer.Option(_W.days_per_week, min=1, help="traffic batches + cycles per week from week 2"),
         episodes: int = typer.Option(_W.episodes_per_day, min=1, help="episodes per day"),
         correction_rate: float = typer.Option(_W.correction_rate, min=0.0, max=1.0, help="share of failures users correct"),
         sft_steps: int = typer.Option(DEMO_RECIPE.sft_steps, min=1), rl_steps: int = typer.Option(DEMO_RECIPE.rl_steps, min=0),
         eval_tasks: int = typer.Option(DEMO_RECIPE.eval_tasks, min=1, help="tasks per family suite"),
         replay_ratio: float = typer.Option(DEMO_RECIPE.replay_ratio, min=0.0, help="verified answers rehearsed per SFT example"),
         min_replay: int = typer.Option(DEMO_RECIPE.min_replay, min=0, help="verified answers rehearsed per SFT stage at least"),
         anchor_rows: int = typer.Option(DEMO_RECIPE.anchor_rows, min=0, help="rows of the base model's SFT data rehearsed per SFT stage"),
         dpo_steps: int = typer.Option(DEMO_RECIPE.dpo_steps, min=0, help="DPO steps on correction vs failed-answer pairs; 0 = off"),
         min_new_failures: int = typer.Option(DEMO_RECIPE.min_new_failures, min=1,
                                              help="held-out new failures a cycle needs to decide (fewer: it waits)"),
         final_tasks: int = typer.Option(DEMO_RECIPE.final_tasks, min=1,
                                         help="tasks per family of the independent final test"),
         seed: int = typer.Option(_W.seed, help="the world's seed: which questions users ask, which failures they correct"),
         threads: int = threads_option()) -> None:
    """A simulated production world drifts week by week; the flywheel serves it, curates its
    failures, trains, gates and promotes. Ends with a table, plots and the `demo:` line."""
    world = WorldConfig(weeks=weeks, days_per_week=days, episodes_per_day=episodes, correction_rate=correction_rate,
                        seed=seed)
    recipe = DemoRecipe(sft_steps=sft_steps, rl_steps=rl_steps, eval_tasks=eval_tasks, replay_ratio=replay_ratio,
                    min_replay=min_replay, anchor_rows=anchor_rows, dpo_steps=dpo_steps,
                    min_new_failures=min_new_failures, final_tasks=final_tasks)
    _, summary = run_demo(out, world, recipe, threads=set_threads(threads))
    for line in summary_lines(summary):
        print(line)
