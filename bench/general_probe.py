"""General ability after real-model demo runs, measured again from their folders: each run's
production model against the base (demo/general.py's probe, the one a demo run takes at its
start and end), with the probe's current questions.

For each run folder (a `flywheel demo --base smollm2-135m-instruct` output, a week-1 run
included): the forward KL per token from the base to production on the base's greedy answers
to 16 everyday chat prompts, and of the simple questions the base answers right, how many
production still answers right (the first sentence holds an accepted answer as a whole word).
Lists each lost question with its reply, beside the base's. The probe is deterministic
(greedy), so the figures depend on the two models and the question set only: a run measured
with an older, shorter set can be measured again with the current one.

    python bench/general_probe.py RUN_DIR [RUN_DIR ...] [--label NAME=TEXT ...]

Prints a table; the last line is `general_probe: runs=N points_lost_median=... kl_median=...`.
Not in `make bench`: it measures folders that earlier runs left (week-1 runs of `python -m
flywheel.demo --base smollm2-135m-instruct --weeks 1`, bench/demo.py's `-- --base ...` runs,
whose own figures use the question set of their day).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


def probe_runs(runs: list[Path], base_name: str, threads: int, labels: dict[str, str] | None = None
               ) -> tuple[str, str, list[dict]]:
    """(table body, last line, per-run figures) for the runs' production models against the base."""
    from flywheel.demo.general import SIMPLE_AFTER, SIMPLE_BEFORE, SIMPLE_QUESTIONS, Probe
    from flywheel.models.packaged import fetch
    from flywheel.registry.registry import Registry

    labels = labels or {}
    for run in runs:
        if not (run / "registry" / "registry.db").exists():
            raise SystemExit(f"{run}: not a demo output folder (no registry/registry.db)")
    base = fetch(base_name, log=lambda m: None)
    folder = Path(tempfile.mkdtemp(prefix="general-probe-"))
    probe = Probe.measure(base, folder)
    before = {r["question"]: r["reply"] for r in map(json.loads, (folder / SIMPLE_BEFORE).read_text().splitlines())}
    rows, lost_lines, figures = [], [], []
    for run in runs:
        with Registry(run / "registry") as registry:
            production = registry.production()
        got = probe.compare(production.path)
        figures.append(got)
        lost = [a for a in map(json.loads, (folder / SIMPLE_AFTER).read_text().splitlines()) if not a["right"]]
        rows.append(f"| {run.name} | {labels.get(str(run), '')} | {production.id} | {got['general_kl']:.4f} | "
                    f"{int(got['simple_kept'])} of {int(got['simple_right_before'])} | {got['simple_points_lost']:.1f} |")
        lost_lines += [f"- {run.name}: {a['question']} -> {a['reply'][:110]!r} (base: {before[a['question']][:70]!r})"
                       for a in lost]
    body = "\n".join([
        f"Machine: {common.machine_line(threads)}. Base: {base_name}; it answers {len(probe.right)} of "
        f"{len(SIMPLE_QUESTIONS)} simple questions right (first-sentence rule); those are asked of each run's "
        f"production model. KL: forward, per token, base -> production, on the base's greedy answers to 16 "
        f"everyday chat prompts.", "",
        "| run | what | production | forward KL | still right | points lost |", "|---|---|---|---|---|---|",
        *rows, "", "Questions lost:" if lost_lines else "No question lost.", *lost_lines])
    points = [f["simple_points_lost"] for f in figures]
    last = (f"general_probe: runs={len(runs)} points_lost_median={statistics.median(points):.1f} "
            f"points_lost_max={max(points):.1f} kl_median={statistics.median(f['general_kl'] for f in figures):.4f} "
            f"right_before={len(probe.right)}")
    return body, last, figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="demo output folders")
    ap.add_argument("--base", default="smollm2-135m-instruct", help="the packaged base the runs started from")
    ap.add_argument("--label", action="append", default=[], help="RUN_DIR=what the run was (shown in the table)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-report", action="store_true", help="print only; do not append to docs/benchmarks.md")
    args = ap.parse_args()
    common.set_threads(args.threads)
    body, last, _ = probe_runs(args.runs, args.base, args.threads, dict(item.split("=", 1) for item in args.label))
    common.append_report("bench/general_probe.py: general ability of real-model demo runs", body, last,
                         write=not args.no_report)


if __name__ == "__main__":
    main()
