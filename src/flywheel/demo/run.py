"""The flagship demo: a simulated production world drifts week by week and the flywheel keeps
the served model up with it.

    flywheel demo [--out flywheel-data/demo] [--episodes 600] [--weeks 3] [--days 2]

1. First-time setup (cached): the base model, taught the week-1 family (demo/base.py).
2. It is registered and promoted (v1) and served over HTTP with trace capture
   (serve/builder.py serve_loop); every response becomes a trace.
3. Each day simulated users (demo/users.py) ask the day's mix of families (demo/world.py),
   report outcomes with verifiers and sometimes a corrected turn; then a cycle
   (loop/cycle.py) curates all traces so far, trains SFT (+ replay) and RL from production,
   scores candidate and incumbent on every family's frozen suite and on the held-out new
   failures, and the gate promotes or rejects; the server follows the registry. The console
   shows one line per stage; <out>/cycles.log holds every line (demo/cycle_log.py). Off a
   terminal, progress is a plain line every 10 s (train/progress.py).
4. After every cycle that changed production, production is scored on each family's
   independent final test (demo/final_test.py), which no decision and no training sees.
5. The end: a table per day and cycle (printed unwrapped, and <out>/report/demo-table.md), the
   report page <out>/report/index.html (the demo's summary and per-day table with the gate's
   reasons, then the economics report), plots, and the last line `demo: new_family_before=X new_family_after=Y old_delta=Z
   final_new_family_before=.. final_new_family_after=.. final_old_delta=.. points_per_usd=..
   cycles=N promoted=M fix_latency_s=.. cycle_s=.. old_kl=..`.

new_family_before / after: the mean, over families that arrive after week 1, of the
production model's greedy success on the family's gate suite (the frozen suite the gate
decides on) when it arrives and after its third cycle (or the last one, if the demo ends
sooner); old_delta: the week-1 family's change on its gate suite from start to end, in points.
final_*: the same figures on the final test, the demo's evidence. points_per_usd: the change
of production's mean final-test success over all families from start to end, in points, per
dollar of every cycle (rejected ones included); the economics report's points per dollar are
the final test's as well.
fix_latency_s: per family arriving after week 1, the wall seconds from its first failed episode
to production serving the first promotion that raised its gate-suite score; the median over
those families (inf while one is unfixed). cycle_s: the median wall seconds of a cycle that
trained (promoted or rejected), from its start to production serving its outcome. old_kl: the forward KL per assistant token from
the base model to the final production model on 64 scripted conversations of the week-1
family's test split (demo/forgetting.py), forgetting measured beside old_delta.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flywheel.demo.base import BaseRecipe, base_demos, base_model
from flywheel.demo.cycle_log import CycleLog, gate_line
from flywheel.demo.report import pct
from flywheel.demo.summary import summarize, summary_lines  # noqa: F401  (summary_lines: cli/demo.py's)
from flywheel.demo.world import ENV, WorldConfig, day_plan

if TYPE_CHECKING:
    from flywheel.loop.loop_config import AnchorLoss


@dataclass(frozen=True)
class DemoRecipe:
    """What each cycle trains and scores: the defaults of `make demo` (and of `flywheel demo`)."""

    sft_steps: int = 300
    rl_steps: int = 20  # GRPO steps after SFT; 0 = off (40 gave multiply +9 points in its first cycle: see README)
    eval_tasks: int = 200  # tasks per family suite
    replay_ratio: float = 2.0  # verified answers rehearsed per SFT example (0.5 let subtract regress add: see README)
    min_replay: int = 256  # ... and at least this many (13 corrections + 26 replays cost add 5 points: see README)
    anchor_rows: int = 256  # rows of the base model's own SFT data rehearsed per SFT stage (see README)
    anchor_loss: AnchorLoss = "imitate"  # or "distill" (LoRA only): loop/loop_config.py CycleTrainConfig
    dpo_steps: int = 0  # DPO on (correction, failed answer) pairs after SFT; 0 = off
    # held-out new failures a cycle needs to decide (gate.min_new_failures); with fewer the day's
    # cycle waits and the next day's traffic adds to them
    min_new_failures: int = 20
    final_tasks: int = 200  # tasks per family of the independent final test (demo/final_test.py)
    lora_rank: int = 0  # 0: full fine-tuning; else every training stage trains a LoRA adapter of this rank
    sft_batch: int = 16
    sft_lr: float = 1e-3


DEMO_RECIPE = DemoRecipe()
FINAL_CYCLES = "final-test-cycles.jsonl"  # per cycle, production's mean final-test success before and after
CYCLE_LOG = "cycles.log"  # every line the cycles logged (the console shows one per stage: demo/cycle_log.py)


@dataclass
class DayRow:
    week: int
    day: int
    served: str  # version that served the day's traffic
    episodes: dict[str, int]  # family -> episodes
    failures: dict[str, int]
    tokens: int
    traffic_s: float
    cycle: str | None = None
    outcome: str = ""
    why: str = ""
    usd: float = 0.0
    new_before: float | None = None  # new-failure suite, incumbent -> candidate
    new_after: float | None = None
    production: dict[str, float] = field(default_factory=dict)  # family suite scores of production after the day
    final: dict[str, float] = field(default_factory=dict)  # family final-test scores of production after the day
    ipd: float | None = None  # final-test points (mean over families) per dollar of a promoting cycle
    serve_usd_per_m: float | None = None
    cycle_s: float = 0.0  # wall seconds of the day's cycle, from its start to production serving its outcome
    # new family -> wall seconds from its first failed episode to this cycle's promoted fix serving
    # (a promotion whose candidate scored higher on the family's gate suite than the incumbent)
    fixed: dict[str, float] = field(default_factory=dict)


def loop_config(out: Path, world: WorldConfig, recipe: DemoRecipe, threads: int, anchor_data: list[str]) -> dict:
    sft_steps, rl_steps, dpo_steps = recipe.sft_steps, recipe.rl_steps, recipe.dpo_steps
    lora = {"rank": recipe.lora_rank, "alpha": 2 * recipe.lora_rank} if recipe.lora_rank else None
    return {
        "data_dir": str(out),
        "curation": {"heldout_fraction": 0.25, "min_heldout": 1},
        "train": {
            "order": ["sft"] + (["dpo"] if dpo_steps else []) + (["rl"] if rl_steps else []), "min_examples": 8,
            "replay_ratio": recipe.replay_ratio, "min_replay": recipe.min_replay,
            "anchor_data": anchor_data, "anchor_rows": recipe.anchor_rows, "anchor_loss": recipe.anchor_loss,
            "sft": {"train": {"steps": sft_steps, "batch_size": recipe.sft_batch, "micro_batch_size": recipe.sft_batch,
                              "lora": lora},
                    "optim": {"lr": recipe.sft_lr, "warmup_steps": min(10, sft_steps // 5), "min_lr_ratio": 0.1},
                    "log": {"progress": False}, "threads": threads},
            # draw_limit 1: flat groups are dropped, not replaced (a new family's first groups are
            # nearly all flat, and replacing them would triple the rollouts of a step)
            "rl": {"train": {"steps": max(rl_steps, 1), "groups_per_step": 8, "group_size": 8, "draw_limit": 1.0,
                             "lora": lora},
                   "sampling": {"temperature": 1.0, "max_tokens": 120}, "optim": {"lr": 5e-5},
                   "algo": {"dynamic_sampling": True}, "eval": {"tasks": 16}, "log": {"progress": False},
                   "threads": threads},
            "dpo": {"train": {"steps": max(dpo_steps, 1), "batch_size": 16, "lora": lora}, "beta": 0.1,
                    "optim": {"lr": 1e-4},
                    "log": {"progress": False}, "threads": threads}},
        "eval": {"suites": {f.name: {"env": ENV, "settings": f.settings, "tasks": recipe.eval_tasks, "max_tokens": 120}
                            for f in world.families if f.arrives <= world.weeks},
                 "new_failures_max_tokens": 120, "new_failures_max": 200},
        "gate": {"delta": 0.05, "epsilon": 0.02, "confidence": 0.95, "min_new_failures": recipe.min_new_failures},
    }


def run_demo(out: Path, world: WorldConfig, recipe: DemoRecipe = DEMO_RECIPE, *, threads: int = 2,
             base_recipe: BaseRecipe | None = None, base: Path | None = None,
             console=None) -> tuple[list[DayRow], dict[str, Any]]:
    """The demo in `out` (recreated). `base`: a pretrained model folder to start from (then no
    tiny base is built, the anchor rows rehearsed are the base's own answers to everyday
    prompts, and its general ability is measured before and after: demo/general.py); else the
    tiny base of `base_recipe`, whose anchor rows are its own SFT data."""
    import torch
    from rich.console import Console

    from flywheel.config import validate
    from flywheel.demo import final_test, general
    from flywheel.demo.users import run_day
    from flywheel.envs import load_env
    from flywheel.loop.cycle import LoopStores, run_cycle
    from flywheel.loop.evaluation import suite_from_config
    from flywheel.loop.loop_config import LoopConfig
    from flywheel.serve.builder import serve_loop

    console = console or Console(soft_wrap=True)  # a piped log: long lines stay whole, not cut at 80 columns
    torch.set_num_threads(threads)
    pretrained = base is not None
    built, t_base = [], time.perf_counter()
    if not pretrained:
        base = base_model(base_recipe, log=lambda m: (built.append(m), console.print(m)))  # logs only when it builds
    base_build_s = time.perf_counter() - t_base if built else 0.0
    shutil.rmtree(out, ignore_errors=True)
    if pretrained:  # no SFT data of its own to rehearse: its own answers to everyday prompts (demo/general.py)
        anchor = [str(general.self_anchor(base, out / "general" / "anchor-rows.jsonl"))] if recipe.anchor_rows else []
    else:
        anchor = [str(base_demos(base))]
    cfg = validate(loop_config(out, world, recipe, threads, anchor), LoopConfig)
    per_family = sum(world.days(w) for w in range(1, world.weeks + 1)) * world.episodes_per_day
    tasks = {f.name: load_env(ENV, **f.settings).tasks("train", n=per_family, seed=world.seed) for f in world.families}
    rows: list[DayRow] = []
    t_start = time.perf_counter()
    with LoopStores(cfg) as fw:
        v1 = fw.registry.register(base, notes="demo base model" + ("" if pretrained else " (week-1 family)"))
        fw.registry.promote(v1.id, "demo start")
        serving = serve_loop(fw)
        console.print(f"serving {v1.id} on {serving.url}")
        cycle_log = CycleLog(out / CYCLE_LOG, lambda m: console.print(f"  {m}", style="dim", markup=False,
                                                                       highlight=False))
        console.print(f"each cycle's full log (the training metrics too): {out / CYCLE_LOG}")
        console.print(f"scoring {v1.id} on each family's gate suite and final test")
        start_scores = _production_scores(fw, cfg)
        general_start = general.Probe.measure(base, out / "general") if pretrained else None
        finals = final_test.final_suites({n: suite_from_config(n, s) for n, s in cfg.eval.suites.items()},
                                         recipe.final_tasks, cfg.eval.new_failures_max_tokens)
        final_start = final_test.score(v1.path, finals)
        first_failure: dict[str, float] = {}  # family -> perf_counter of its first failed episode
        try:
            for week in range(1, world.weeks + 1):
                new = world.new(week)
                console.rule(f"[bold]week {week}[/]: users ask " + ", ".join(f.name for f in world.live(week))
                             + (f" — [bold red]new: {new.name}[/]" if new else ""))
                for day in range(1, world.days(week) + 1):
                    row = _traffic(fw, serving, world, tasks, week, day, run_day, console, first_failure)
                    rows.append(row)
                    t_cycle = time.perf_counter()
                    st = run_cycle(fw, log=cycle_log)
                    serving.switch_now()
                    served_at = time.perf_counter()
                    row.cycle_s = served_at - t_cycle
                    _fill_cycle(row, st, cfg, fw)
                    _record_fixes(row, st, world, first_failure, served_at, rows)
                    if gate := gate_line(row.cycle, row.outcome, row.why):
                        console.print(f"  {gate}", markup=False, highlight=False)
                    if not row.production:  # no candidate was evaluated: production did not change
                        row.production = dict(rows[-2].production) if len(rows) > 1 else dict(start_scores)
                    before = rows[-2].final if len(rows) > 1 else final_start
                    promoted = st.outcome == "promoted"
                    row.final = final_test.score(fw.registry.production().path, finals) if promoted else dict(before)
                    _record_final(out / FINAL_CYCLES, row, before)
                    console.print(_day_line(row))
        finally:
            serving.close()
        summary = summarize(rows, world, start_scores, final_start, time.perf_counter() - t_start, base_build_s)
        summary["old_kl"] = _old_family_kl(base, fw.registry.production().path, world, out)
        if general_start is not None:
            console.print("measuring general ability (chat prompts and simple questions) against the base")
            summary["general"] = general_start.compare(fw.registry.production().path)
        _write_report(fw, out, rows, console, summary)
    return rows, summary


def _production_scores(fw, cfg) -> dict[str, float]:
    from flywheel.loop.evaluation import evaluate_model, suite_from_config

    prod = fw.registry.production()
    result = evaluate_model(prod.path, [suite_from_config(n, s) for n, s in cfg.eval.suites.items()])
    fw.ledger.record("eval", hardware=fw.cfg.hardware, seconds=result.seconds,
                     tokens_generated=result.tokens_generated, extra={"what": f"{prod.id} before the first week"})
    return result.scores


def _record_fixes(row: DayRow, st, world: WorldConfig, first_failure: dict[str, float], served_at: float,
                  rows: list[DayRow]) -> None:
    """row.fixed: the new families this promotion fixed first (their gate-suite score above the
    incumbent's), with the wall seconds since each one's first failed episode."""
    if st.outcome != "promoted":
        return
    inc, cand = st.scores.get("incumbent", {}), st.scores.get("candidate", {})
    fixed_before = {f for r in rows for f in r.fixed}
    for f in world.families:
        if (f.arrives > 1 and f.name in first_failure and f.name not in fixed_before
                and cand.get(f.name, 0.0) > inc.get(f.name, 0.0)):
            row.fixed[f.name] = served_at - first_failure[f.name]


def _old_family_kl(base: Path, production: str | Path, world: WorldConfig, out: Path, n: int = 64) -> float:
    """Forward KL from the base to production on `n` scripted conversations of the week-1
    family's test split (demo/forgetting.py): the forgetting beside the accuracy."""
    from flywheel.demo.final_test import FINAL_SEED
    from flywheel.demo.forgetting import forward_kl
    from flywheel.envs import load_env
    from flywheel.rollout.demos import make_demos

    rows = out / "forgetting-rows.jsonl"
    make_demos(load_env(ENV, **world.families[0].settings), n, split="test", seed=FINAL_SEED, out=rows)
    return forward_kl(base, production, rows)


def _traffic(fw, serving, world: WorldConfig, tasks, week: int, day: int, run_day, console,
             first_failure: dict[str, float]) -> DayRow:
    from flywheel.train.progress import CountProgress

    plan = day_plan(world, week, day)
    work = [(family, tasks[family][i]) for family, i in plan]
    served = serving.version
    t0 = time.perf_counter()
    # a bar on a terminal; off one (a piped log) a line every 10 s
    with CountProgress(f"  week {week} day {day} traffic on {served}", len(work), console) as bar:
        done = {"n": 0, "ok": 0}

        def tick(ep) -> None:
            done["n"] += 1
            done["ok"] += ep.success
            if not ep.success:
                first_failure.setdefault(ep.family, time.perf_counter())
            bar.update(done["n"], f"{done['ok']} solved")

        episodes = asyncio.run(run_day(serving.url, work, world.concurrency, world.correction_rate,
                                       f"demo/{world.seed}/{week}/{day}/feedback", on_episode=tick))
    seconds = time.perf_counter() - t0
    errors = [ep.error for ep in episodes if ep.error]
    if errors:
        raise RuntimeError(f"{len(errors)} episodes failed at the HTTP level, e.g. {errors[0]}")
    counts: dict[str, int] = {}
    fails: dict[str, int] = {}
    for ep in episodes:
        counts[ep.family] = counts.get(ep.family, 0) + 1
        fails[ep.family] = fails.get(ep.family, 0) + (not ep.success)
    tokens = sum(ep.completion_tokens for ep in episodes)
    fw.ledger.record("serve", hardware=fw.cfg.hardware, seconds=seconds, tokens_served=tokens,
                     extra={"week": week, "day": day, "episodes": len(episodes)})
    return DayRow(week, day, served, counts, fails, tokens, seconds)


def _fill_cycle(row: DayRow, st, cfg, fw) -> None:
    row.cycle, row.outcome, row.usd = st.id, st.outcome or st.stage, st.usd
    name = cfg.gate.new_failures
    inc, cand = st.scores.get("incumbent", {}), st.scores.get("candidate", {})
    row.new_before, row.new_after = inc.get(name), cand.get(name)
    reasons = st.decision.get("reasons", [])
    if st.outcome == "rejected":
        row.why = next((r for r in reasons if "<" in r or "drops" in r or "no " in r), "; ".join(reasons))
    elif st.outcome == "nothing to train":
        row.why = "; ".join(s.get("skipped", "") for s in st.stages_run)
    else:
        row.why = reasons[0] if reasons else ""
    prod = cand if st.outcome == "promoted" else inc
    row.production = {k: v for k, v in prod.items() if k != name}
    serve_usd = sum(r.usd for r in fw.ledger.records if r.stage == "serve" and r.extra.get("week") == row.week
                    and r.extra.get("day") == row.day)
    row.serve_usd_per_m = serve_usd / row.tokens * 1e6 if row.tokens else None


def _day_line(row: DayRow) -> str:
    fails = ", ".join(f"{f} {row.failures[f]}/{row.episodes[f]} failed" for f in row.episodes)
    scores = " ".join(f"{k} {pct(v)}" for k, v in row.production.items())
    return (f"  week {row.week} day {row.day}: {fails} ({row.traffic_s:.0f} s) -> {row.cycle} [bold]{row.outcome}[/]"
            f" (${row.usd:.4f}); production now: {scores}")


def _record_final(path: Path, row: DayRow, before: dict[str, float]) -> None:
    """The cycle's outcome on the final test, as an economics cycles line (the mean over
    families of production before and after it) and the row's points per dollar."""
    from flywheel.demo.final_test import mean_gain_points
    from flywheel.economics.ledger import append_line
    from flywheel.economics.reports import CycleOutcome, intelligence_per_dollar

    promoted = row.outcome == "promoted"
    mean = lambda d: sum(d.values()) / len(d)  # noqa: E731
    append_line(path, CycleOutcome(cycle=row.cycle, accuracy_before=mean(before), accuracy_after=mean(row.final),
                                   promoted=promoted, reason=f"final test: {row.outcome}").model_dump_json())
    if promoted and row.usd > 0:
        row.ipd = intelligence_per_dollar(mean_gain_points(before, row.final), row.usd).value


def _write_report(fw, out: Path, rows: list[DayRow], console, summary: dict[str, Any] | None = None) -> None:
    """report/index.html (the demo's summary and per-day table, then the economics report, whose
    points are the final test's), the plots, and demo-table.md, which is also printed unwrapped."""
    from flywheel.demo.page import EVAL_NAME, TITLE, demo_html
    from flywheel.demo.report import family_plot, markdown_table, write_table
    from flywheel.economics.reports import read_cycles
    from flywheel.economics.tables import build_report
    from flywheel.economics.render import write_report

    report_dir = out / "report"
    final = out / FINAL_CYCLES  # points per dollar from the final test, not from the gate's suites
    outcomes = read_cycles(final) if final.exists() else []
    rep = build_report(fw.ledger.read(), outcomes, sources={"ledger": str(fw.ledger.path), "final test": str(final)},
                       eval_name=EVAL_NAME)
    paths = write_report(rep, report_dir, extra_plots={"families.png": family_plot(rows)}, title=TITLE,
                         intro_html=demo_html(summary, rows) if summary else "")
    table = write_table(markdown_table(rows), report_dir, console)
    console.print(f"report: {report_dir / 'index.html'}, {table.name}, "
                  + ", ".join(p.name for n, p in paths.items() if n.endswith('.png')), markup=False, highlight=False)
