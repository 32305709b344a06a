"""PNG plots of an EconomicsReport, drawn with matplotlib's Agg canvas (no pyplot, no display).

Each `*_figure` function returns a Figure, or None when the report has nothing to draw for it;
render_all turns them into PNG bytes. Legends sit outside the axes, where they cover no data.
"""

from __future__ import annotations

import io

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from flywheel.economics.tables import EconomicsReport


def png(fig: Figure) -> bytes:
    """The figure as PNG bytes (Agg canvas, tight layout, 110 dpi)."""
    FigureCanvasAgg(fig)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def cost_by_cycle_figure(report: EconomicsReport) -> Figure | None:
    """Stacked bars: each cycle's cost split by stage."""
    if not report.cycles:
        return None
    stages = sorted({s for c in report.cycles for s in c.usd_by_stage})
    fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    x = list(range(len(report.cycles)))
    bottom = [0.0] * len(x)
    for s in stages:
        h = [c.usd_by_stage.get(s, 0.0) for c in report.cycles]
        ax.bar(x, h, bottom=bottom, label=s)
        bottom = [b + v for b, v in zip(bottom, h)]
    ax.set_xticks(x, [c.cycle for c in report.cycles], rotation=30, ha="right")
    ax.set_ylabel("USD")
    ax.set_title("Cost per cycle, by stage")
    if stages:  # right of the axes: over the bars it hid the tallest one
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="stage", title_fontsize=8)
    return fig


def cumulative_figure(report: EconomicsReport) -> Figure | None:
    """Cumulative dollars vs cumulative realised accuracy points on the report's eval (its
    `eval_name`, e.g. the demo's final test), one marker per cycle."""
    if not any(c.outcome for c in report.cycles):
        return None
    xs, ys = zip(*report.curve)
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    ax.plot(xs, ys, marker="o", drawstyle="default")
    for c, (x, y) in zip(report.cycles, report.curve[1:]):
        ax.annotate(c.cycle, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.axhline(0, color="grey", linewidth=0.5)
    ax.margins(x=0.06, y=0.1)  # room for the last cycle's label inside the frame
    ax.set_xlabel("cumulative cost (USD)")
    ax.set_ylabel("cumulative realised gain\n(accuracy points)")
    ax.set_title(f"Intelligence per dollar: points on the {report.eval_name}\n"
                 "(a promoted cycle adds its gain, a rejected one adds 0)", fontsize=10)
    return fig


def cost_per_million_figure(report: EconomicsReport) -> Figure | None:
    """Bars: measured USD per 1M tokens for each family that has tokens."""
    fams = [f for f in report.families if f.usd_per_million is not None]
    if not fams:
        return None
    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    ax.bar([f.family for f in fams], [f.usd_per_million for f in fams], color="tab:green")
    ax.set_ylabel("USD per 1M tokens")
    ax.set_title("Measured cost per 1M tokens")
    return fig


def projection_figure(report: EconomicsReport) -> Figure | None:
    """Horizontal bars: measured cost vs the ESTIMATE on each target (log scale)."""
    if not report.projections:
        return None
    measured = report.projections[0].measured_usd
    source = ", ".join(sorted({r.hardware for r in report.records})) or "?"
    names = [f"measured ({source})"] + [f"{p.target.name} (estimate)" for p in report.projections]
    values = [measured] + [p.estimated_usd for p in report.projections]
    if not any(v > 0 for v in values):
        return None
    colors = ["tab:blue"] + ["tab:orange"] * len(report.projections)
    fig = Figure(figsize=(8, 0.6 * len(names) + 1.8))
    ax = fig.subplots()
    ax.barh(names, values, color=colors)
    ax.invert_yaxis()
    positive = [v for v in values if v > 0]
    if positive and max(positive) / min(positive) > 100:
        ax.set_xscale("log")
    ax.set_xlabel("USD")
    ax.set_title(f"ESTIMATE: the same run on other hardware\n(assumed MFU {report.mfu:.2f}; "
                 "2P FLOPs per forward token, 6P per trained token)", fontsize=10)
    return fig


PLOTS = {
    "cost_by_cycle.png": cost_by_cycle_figure,
    "cumulative.png": cumulative_figure,
    "cost_per_million.png": cost_per_million_figure,
    "projection_estimate.png": projection_figure,
}


def render_all(report: EconomicsReport) -> dict[str, bytes]:
    """File name -> PNG bytes for every plot that has data."""
    out = {}
    for name, fn in PLOTS.items():
        fig = fn(report)
        if fig is not None:
            out[name] = png(fig)
    return out
