"""The demo's closing figures (a dict, the `demo:` line and the lines before it), from the
per-day rows. The figures are defined in demo/run.py's docstring."""

from __future__ import annotations

import statistics
from typing import Any

from flywheel.demo.report import pct
from flywheel.demo.world import WorldConfig


def new_family_figures(rows: list, world: WorldConfig, start: dict[str, float], scores) -> tuple[float, float]:
    """(mean over families arriving after week 1 of production's score when the family
    arrives, the same after its third cycle or the last one); `scores(row)` picks the figures."""
    news = [f for f in world.families if 1 < f.arrives <= world.weeks]
    before, after = [], []
    for f in news:
        arrival = next(i for i, r in enumerate(rows) if r.week == f.arrives)
        at_arrival = scores(rows[arrival - 1]) if arrival > 0 else start
        before.append(at_arrival.get(f.name, start.get(f.name, 0.0)))
        after.append(scores(rows[min(arrival + 2, len(rows) - 1)]).get(f.name, 0.0))  # its third cycle
    nan = float("nan")
    return (sum(before) / len(before) if before else nan), (sum(after) / len(after) if after else nan)


def summarize(rows: list, world: WorldConfig, start: dict[str, float], final_start: dict[str, float],
              seconds: float, base_build_s: float = 0.0) -> dict[str, Any]:
    """The demo's figures; `seconds`: the demo after its base model was ready; `base_build_s`:
    the first-time build of that model in this run (0 when it came from the cache)."""
    from flywheel.demo.final_test import mean_gain_points

    first = world.families[0].name
    end = rows[-1].production if rows else start
    final_end = rows[-1].final if rows else final_start
    before, after = new_family_figures(rows, world, start, lambda r: r.production)
    final_before, final_after = new_family_figures(rows, world, final_start, lambda r: r.final)
    usd = sum(r.usd for r in rows)
    latencies = [s for r in rows for s in r.fixed.values()]
    fixed = {f for r in rows for f in r.fixed}
    news = [f.name for f in world.families if 1 < f.arrives <= world.weeks]
    cycle_s = sorted(r.cycle_s for r in rows if r.outcome in ("promoted", "rejected"))  # cycles that trained
    return {"fix_latency_s": (statistics.median(latencies) if len(fixed) == len(news) and latencies else float("inf")),
            "fix_latency": {f: next((r.fixed[f] for r in rows if f in r.fixed), None) for f in news},
            "cycle_s": statistics.median(cycle_s) if cycle_s else float("nan"),"new_family_before": before, "new_family_after": after,
            "old_delta": 100 * (end.get(first, 0.0) - start.get(first, 0.0)),
            "final_new_family_before": final_before, "final_new_family_after": final_after,
            "final_old_delta": 100 * (final_end.get(first, 0.0) - final_start.get(first, 0.0)),
            "final_points": mean_gain_points(final_start, final_end), "usd": usd,
            "points_per_usd": mean_gain_points(final_start, final_end) / usd if usd > 0 else float("nan"),
            "cycles": sum(r.cycle is not None for r in rows),
            "promoted": sum(r.outcome == "promoted" for r in rows), "seconds": seconds,
            "base_build_s": base_build_s,
            "per_family": {f.name: {"start": start.get(f.name), "end": end.get(f.name),
                                    "final_start": final_start.get(f.name), "final_end": final_end.get(f.name)}
                           for f in world.families if f.name in end}}


def took_line(s: dict[str, Any]) -> str:
    """How long the demo took, the base model's first-time build said apart."""
    took = f"demo took {s['seconds'] / 60:.1f} min"
    built = s.get("base_build_s") or 0.0
    if built:
        return took + f", after {built / 60:.1f} min building its base model (first run only: cached for later runs)"
    return took + " (its base model came from the cache)"


def general_line(g: dict[str, float]) -> str:
    """A pretrained base's general ability at the end against the start (demo/general.py)."""
    return (f"general ability against the base: forward KL {g['general_kl']:.4f} per token on everyday chat "
            f"prompts; simple questions it answered right: {g['simple_kept']:.0f} of {g['simple_right_before']:.0f} "
            f"still right ({g['simple_points_lost']:.1f} points lost), {g['simple_gained']:.0f} it missed now right "
            f"(net {g['simple_net_points_lost']:.1f} points lost)")


def summary_lines(s: dict[str, Any]) -> list[str]:
    """The demo's closing lines; the last is the `demo: ...` line."""
    general = [general_line(s["general"])] if s.get("general") else []
    return [took_line(s) + "; gate suites: " + ", ".join(
                f"{k} {pct(v['start'])} -> {pct(v['end'])}" for k, v in s["per_family"].items())
            + "; final test: " + ", ".join(
                f"{k} {pct(v['final_start'])} -> {pct(v['final_end'])}" for k, v in s["per_family"].items()),
            *general,
            f"demo: new_family_before={s['new_family_before']:.2f} new_family_after={s['new_family_after']:.2f} "
            f"old_delta={s['old_delta']:+.1f} final_new_family_before={s['final_new_family_before']:.2f} "
            f"final_new_family_after={s['final_new_family_after']:.2f} final_old_delta={s['final_old_delta']:+.1f} "
            f"points_per_usd={s['points_per_usd']:.0f} cycles={s['cycles']} promoted={s['promoted']} "
            f"fix_latency_s={s['fix_latency_s']:.0f} cycle_s={s['cycle_s']:.0f} old_kl={s.get('old_kl', float('nan')):.4f}"]
