"""General ability after real-model demo runs, measured again from their folders: each run's
production model against the base (demo/general.py's probe, the one a demo run takes at its
start and end), with the probe's current questions, beside a control with no content.

For each run folder (a `flywheel demo --base smollm2-135m-instruct` output, a week-1 run
included): the forward KL per token from the base to production on the base's greedy answers
to 16 everyday chat prompts, and of the simple questions (all asked of both models): how many
the base answered right, how many of those production still answers right (lost: one-sided
points), how many it missed that production answers right (gained), and the net points lost.
Lists each lost and gained question with both replies.

The control (`--noise SIGMAS`, `--noise-seeds N`): copies of the base with Gaussian noise on
every weight matrix, sigma times that matrix's RMS (the output head's noise reaches the
embeddings where the two are tied, as in SmolLM2), no training at all,
measured the same way. Whatever they "lose" is the probe's churn, not forgetting.

`--sampled K`: also K replies per question sampled at temperature 1, the share right per
model against the base's, paired over the questions (a finer grain than greedy right or wrong).

The greedy probe is deterministic, so the figures depend on the two models and the question
set only: a run measured with an older, shorter set can be measured again with the current one.

    python bench/general_probe.py RUN_DIR [RUN_DIR ...] [--label NAME=TEXT ...] [--noise 0.005,0.01,0.02]

Prints a table; the last line is `general_probe: runs=N points_lost_median=...
net_points_lost_median=... kl_median=... noise_points_lost_median=... noise_net_points_lost_median=...`.
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


def noisy_copy(base: Path, sigma: float, seed: int, out: Path) -> Path:
    """The base with N(0, (sigma x RMS(W))^2) added to each 2-D weight W of its state dict
    but those named as embeddings, saved as a folder at `out`: a change with no content. A head
    tied to the embeddings (SmolLM2, the tiny models) is one tensor under two names: it takes
    the head's noise, so the embeddings move with it."""
    import torch

    from flywheel.models import load
    from flywheel.train.checkpoint import save_model_folder

    model, tokenizer = load(base)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, w in model.state_dict().items():
            if w.ndim == 2 and "embed" not in name:
                w.add_(sigma * w.pow(2).mean().sqrt() * torch.randn(w.shape, generator=g))
    save_model_folder(model, tokenizer, out)
    return out


def sampled_right(model_dir: str | Path, k: int, seed: int = 0) -> list[float]:
    """Per simple question, the share of k replies sampled at temperature 1 whose first sentence
    is right (each reply stops at its first sentence's end, which is all the rule reads)."""
    from flywheel.demo.general import QUESTION_TOKENS, SIMPLE_QUESTIONS, answered_right, replies
    from flywheel.inference import SamplingParams

    params = SamplingParams(n=k, temperature=1.0, max_tokens=QUESTION_TOKENS, stop=(". ", "! ", "? ", "\n"))
    out = replies(model_dir, [q for q, _ in SIMPLE_QUESTIONS], params, seed=seed)
    return [sum(answered_right(r.text, accepted) for r in samples) / k
            for samples, (_, accepted) in zip(out, SIMPLE_QUESTIONS)]


def paired_points(after: list[float], before: list[float]) -> tuple[float, float, float]:
    """(mean difference, 95 % low, 95 % high) in percentage points over paired per-question
    shares (a normal interval on the questions' differences)."""
    d = [100 * (a - b) for a, b in zip(after, before)]
    m = statistics.fmean(d)
    half = 1.96 * statistics.stdev(d) / len(d) ** 0.5
    return m, m - half, m + half


def probe_runs(runs: list[Path], base_name: str, threads: int, labels: dict[str, str] | None = None,
               noise: tuple[float, ...] = (), noise_seeds: int = 3, sampled: int = 0) -> tuple[str, str, list[dict]]:
    """(table body, last line, per-model figures) for the runs' production models and the noisy
    copies of the base, each against the base; with `sampled` = k > 0 also each model's share
    of right replies among k sampled per question, against the base's."""
    import shutil

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
    before = {r["question"]: r for r in map(json.loads, (folder / SIMPLE_BEFORE).read_text().splitlines())}
    models = []  # (name, what, model folder, is a control)
    for run in runs:
        with Registry(run / "registry") as registry:
            production = registry.production()
        models.append((run.name, f"{labels.get(str(run), '')} ({production.id})".strip(), production.path, False))
    for sigma in noise:
        for seed in range(noise_seeds):
            copy = noisy_copy(base, sigma, seed, folder / f"noise-{sigma}-{seed}")
            models.append((f"noise {sigma} seed {seed}", "base + Gaussian noise, no training", copy, True))
    rows, moved, figures = [], [], []
    base_sampled = sampled_right(base, sampled) if sampled else []
    for name, what, path, control in models:
        got = {**probe.compare(path), "control": control}
        sampled_cells, now = "", []
        if sampled:
            mean = statistics.fmean(now := sampled_right(path, sampled))
            diff, low, high = paired_points(now, base_sampled)
            got.update(sampled_right=100 * mean, sampled_points=diff)
            sampled_cells = f" {100 * mean:.1f} | {diff:+.1f} ({low:+.1f} to {high:+.1f}) |"
        figures.append(got)
        if control:
            shutil.rmtree(path)
        rows.append(f"| {name} | {what} | {got['general_kl']:.4f} | {int(got['simple_kept'])} of "
                    f"{int(got['simple_right_before'])} | {got['simple_points_lost']:.1f} | {int(got['simple_gained'])} | "
                    f"{int(got['simple_right_after'])} | {got['simple_net_points_lost']:+.1f} |{sampled_cells}")
        if not control:
            for i, a in enumerate(map(json.loads, (folder / SIMPLE_AFTER).read_text().splitlines())):
                if a["right"] != before[a["question"]]["right"]:
                    rates = f"; sampled right {base_sampled[i]:.2f} -> {now[i]:.2f}" if sampled else ""
                    moved.append(f"- {name}: {'gained' if a['right'] else 'lost'}: {a['question']} -> "
                                 f"{a['reply'][:100]!r} (base: {before[a['question']]['reply'][:70]!r}{rates})")
    body = "\n".join([
        f"Machine: {common.machine_line(threads)}. Base: {base_name}; it answers {len(probe.right)} of "
        f"{len(SIMPLE_QUESTIONS)} simple questions right (first-sentence rule, greedy); every question is asked "
        f"of each model. Points are per 100 questions the base answered right: lost one-sided (right before, "
        f"wrong now) and net ((right before - right now), negative: a gain). KL: forward, per token, base -> "
        f"model, on the base's greedy answers to 16 everyday chat prompts. Noise rows: the base with Gaussian "
        f"noise on its weight matrices, the tied head and embeddings included (sigma x each matrix's RMS), "
        f"no training: the probe's churn.", "",
        *([f"Sampled: {sampled} replies per question at temperature 1, each cut at its first sentence; the share "
           f"right, the base's {100 * statistics.fmean(base_sampled):.1f} %, and the paired difference in points "
           f"with its 95 % interval over the {len(SIMPLE_QUESTIONS)} questions.", ""] if sampled else []),
        "| model | what | forward KL | still right | points lost (one-sided) | gained | right now | net points lost |"
        + (" sampled right % | sampled points vs base |" if sampled else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|---|" if sampled else ""), *rows, "", "Questions that moved (runs only):" if moved else "", *moved])
    trained = [f for f in figures if not f["control"]]
    controls = [f for f in figures if f["control"]]

    def med(rows: list[dict], key: str) -> str:
        return f"{statistics.median(f[key] for f in rows):.4g}" if rows else "nan"

    last = (f"general_probe: runs={len(trained)} points_lost_median={med(trained, 'simple_points_lost')} "
            f"net_points_lost_median={med(trained, 'simple_net_points_lost')} kl_median={med(trained, 'general_kl')} "
            f"right_before={len(probe.right)} controls={len(controls)} "
            f"noise_points_lost_median={med(controls, 'simple_points_lost')} "
            f"noise_net_points_lost_median={med(controls, 'simple_net_points_lost')} "
            f"noise_kl_median={med(controls, 'general_kl')}"
            + (f" sampled_points_median={med(trained, 'sampled_points')} "
               f"noise_sampled_points_median={med(controls, 'sampled_points')}" if sampled else ""))
    return body, last, figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="*", type=Path, help="demo output folders")
    ap.add_argument("--base", default="smollm2-135m-instruct", help="the packaged base the runs started from")
    ap.add_argument("--label", action="append", default=[], help="RUN_DIR=what the run was (shown in the table)")
    ap.add_argument("--noise", default="", help="comma-separated sigmas of the no-content control, e.g. 0.005,0.01,0.02")
    ap.add_argument("--noise-seeds", type=int, default=3, help="noisy copies per sigma")
    ap.add_argument("--sampled", type=int, default=0, metavar="K",
                    help="also K replies per question sampled at temperature 1 (about 2.5 min a model with 16)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-report", action="store_true", help="print only; do not append to docs/benchmarks.md")
    args = ap.parse_args()
    common.set_threads(args.threads)
    try:
        noise = tuple(float(x) for x in args.noise.split(",") if x.strip())
    except ValueError:
        ap.error(f"--noise: comma-separated numbers expected, got {args.noise!r}")
    if any(sigma < 0 for sigma in noise) or args.noise_seeds < 1 or args.sampled < 0:
        ap.error(f"--noise sigmas must be >= 0 (got {args.noise!r}), --noise-seeds >= 1 (got {args.noise_seeds}), "
                 f"--sampled >= 0 (got {args.sampled})")
    if not args.runs and not noise:
        ap.error("nothing to measure: give run folders, --noise sigmas, or both")
    if bad := [item for item in args.label if "=" not in item]:
        ap.error(f"--label takes RUN_DIR=TEXT, got {bad[0]!r}")
    body, last, _ = probe_runs(args.runs, args.base, args.threads, dict(item.split("=", 1) for item in args.label),
                               noise, args.noise_seeds, args.sampled)
    common.append_report("bench/general_probe.py: general ability of real-model demo runs", body, last,
                         write=not args.no_report)


if __name__ == "__main__":
    main()
