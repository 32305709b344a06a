"""The demo's table (markdown, printed and written next to the plots) and its family plot."""

from __future__ import annotations

from typing import Sequence


def pct(x: float | None) -> str:
    """0.873 -> '87%'; None -> '-'."""
    return "-" if x is None else f"{100 * x:.0f}%"


def markdown_table(rows: Sequence) -> str:
    """One line per day: traffic and failure rate per family (as served that day), the cycle
    that followed, its cost, new-failure score incumbent -> candidate, the production model's
    suite scores after it, its final-test scores (demo/final_test.py: never used for a decision),
    intelligence per dollar (final-test points / $ of a promoting cycle) and serving cost per 1M
    tokens."""
    families = list(dict.fromkeys(f for r in rows for f in r.episodes))
    suites = list(dict.fromkeys(f for r in rows for f in r.production))
    finals = list(dict.fromkeys(f for r in rows for f in r.final))
    head = (["week", "day", "served", "traffic"] + [f"{f} failed" for f in families]
            + ["cycle", "outcome", "why", "cost $", "new failures"] + [f"{s} gate suite" for s in suites]
            + [f"{f} final test" for f in finals] + ["final points/$", "serve $/1M tok"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        fails = [pct(r.failures[f] / r.episodes[f]) if r.episodes.get(f) else "-" for f in families]
        new = f"{pct(r.new_before)} -> {pct(r.new_after)}" if r.new_before is not None else "-"
        cells = ([str(r.week), str(r.day), r.served, str(sum(r.episodes.values()))] + fails
                 + [r.cycle or "-", r.outcome, r.why.replace("|", "/"), f"{r.usd:.4f}", new]
                 + [pct(r.production.get(s)) for s in suites] + [pct(r.final.get(f)) for f in finals]
                 + ["-" if r.ipd is None else f"{r.ipd:,.0f}",
                    "-" if r.serve_usd_per_m is None else f"{r.serve_usd_per_m:.3f}"])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def family_plot(rows: Sequence) -> bytes:
    """PNG: the production model's success per family after each day's cycle."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.8))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    labels = [f"w{r.week}d{r.day}" for r in rows]
    for fam in dict.fromkeys(f for r in rows for f in r.production):
        line, = ax.plot(labels, [100 * r.production.get(fam, float("nan")) for r in rows], marker="o",
                        label=f"{fam} (gate suite)")
        if any(fam in r.final for r in rows):
            ax.plot(labels, [100 * r.final.get(fam, float("nan")) for r in rows], ls="--", marker="x",
                    color=line.get_color(), label=f"{fam} (final test)")
    for i, r in enumerate(rows):
        if r.outcome == "promoted":
            ax.axvline(i, color="grey", alpha=0.2, lw=6)
    ax.set_ylim(-3, 103)
    ax.set_ylabel("held-out success of production, %")
    ax.set_title("flywheel demo: each family's success after each day's cycle (grey: promoted)")
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()
