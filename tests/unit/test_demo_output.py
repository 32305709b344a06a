"""The demo's output as a user reads it (issue 35, point 9), from a small fake demo result: the
console's one line per cycle stage with the rest in cycles.log, the unwrapped table and its
file, the closing line's base-build time, and the report page (title, summary, per-day table
with outcomes and gate reasons, link to demo-table.md, the final test named as what points
count, the total's split into cycles and the rest, legends off the data)."""

from __future__ import annotations

import html
import io
import re
from types import SimpleNamespace

import pytest
import yaml
from rich.console import Console

from flywheel.demo.cycle_log import CycleLog, gate_line, stage_line
from flywheel.demo.report import family_figure, markdown_table, write_table
from flywheel.demo.run import DayRow, _write_report
from flywheel.demo.summary import summarize, summary_lines
from flywheel.demo.world import WorldConfig
from flywheel.economics import CycleOutcome, Ledger, load_catalog
from flywheel.economics.plots import cost_by_cycle_figure, cumulative_figure
from flywheel.economics.tables import build_report

# toy-cpu costs $3.6 an hour: $0.001 a second
TOY = {"version": 1, "as_of": "2026-01-01", "hardware": [{
    "name": "toy-cpu", "kind": "cpu", "unit": "1 device", "usd_per_hour": 3.6, "peak_tflops": 1.0,
    "precision": "fp32", "memory_bandwidth_gb_s": 10.0, "memory_gb": 8.0, "sources": ["by hand"]}]}
WHY_REJECTED = ("new_failures 0.000 -> 0.089 (+8.9 pts, 95% lower bound +4.95 pts; 9 gained, 0 lost of 101 tasks) "
                "< delta 5.00 pts")
CYCLE_MESSAGES = [  # what run_cycle logs, its recipes' lines passed through (no cycle prefix)
    ("c2: started from v1 with traces up to #1200", False),
    ("c2: curated 1200 traces: rl 30+10, sft 20+0 (train+held-out); 10 new failures to gate on", True),
    ("c2: sft on 20 examples from final", True),
    ("c2: sft mix: 20 corrections, 256 replay, 256 anchor", False),
    ("train data: 532 examples, 0 skipped", False),
    ("step 50: loss=0.4123, lr=0.0009", False),
    ("c2: rl on 30 examples from final", True),
    ("step 10: reward=0.512, kl=0.003, entropy=0.731, clip_frac=0.000, tokens_per_s=812.345, stale=0.000", False),
    ("c2: rl skipped (3 curated examples < min_examples 8)", True),
    ("c2: warning: no held-out RL tasks; the rl stage's own evaluations are on its train tasks", True),
    ("c2: evaluating incumbent and candidate on add (200), new_failures (10)", True),
    ("c2: incumbent: add 0.820, new_failures 0.000", False),
    ("c2: gate: reject: " + WHY_REJECTED, False),
    ("c2: rejected (v3)", False),
    ("c2: retention freed 12.0 MB of optimizer state", False),
    ("c3: too few new failures to decide: 5 < 20; waiting", True),
]


def test_the_console_gets_one_line_per_stage_and_the_file_every_line(tmp_path):
    for message, shown in CYCLE_MESSAGES:
        assert stage_line(message) is shown, message
    echoed = []
    log = CycleLog(tmp_path / "cycles.log", echoed.append, clock=lambda: 0.0)
    for message, _ in CYCLE_MESSAGES:
        log(message)
    assert echoed == [m for m, shown in CYCLE_MESSAGES if shown]
    written = (tmp_path / "cycles.log").read_text().splitlines()
    assert [w.split(" ", 1)[1] for w in written] == [m for m, _ in CYCLE_MESSAGES]
    assert all(re.fullmatch(r"\d\d:\d\d:\d\d", w.split(" ", 1)[0]) for w in written)


def test_the_gate_line_is_the_deciding_reason_of_a_decided_cycle():
    assert gate_line("c2", "rejected", WHY_REJECTED) == "c2: gate: " + WHY_REJECTED
    assert gate_line("c3", "promoted", "new_failures ... >= delta 5.0 pts") == "c3: gate: new_failures ... >= delta 5.0 pts"
    assert gate_line("c4", "waiting", "too few new failures to decide: 5 < 20; waiting") is None  # echoed already
    assert gate_line("c5", "nothing to train", "sft skipped (budget spent)") is None


def rows() -> list[DayRow]:
    """A two-week world of one day each, plus a second week-2 day: c1 rejected, c2 and c3 promoted."""
    return [
        DayRow(1, 1, "v1", {"add": 600}, {"add": 96}, 9000, 40.0, cycle="c1", outcome="rejected", why=WHY_REJECTED,
               usd=0.004, new_before=0.0, new_after=0.089, production={"add": 0.82, "subtract": 0.0},
               final={"add": 0.88, "subtract": 0.0}, serve_usd_per_m=0.011),
        DayRow(2, 1, "v1", {"add": 300, "subtract": 300}, {"add": 50, "subtract": 300}, 9500, 41.0, cycle="c2",
               outcome="promoted", why="new_failures 0.005 -> 0.092 (+8.7 pts, ...) >= delta 5.0 pts [sic]",
               usd=0.003, new_before=0.005, new_after=0.092, production={"add": 0.87, "subtract": 0.02},
               final={"add": 0.89, "subtract": 0.02}, ipd=273.0, serve_usd_per_m=0.018, cycle_s=50.0,
               fixed={"subtract": 95.0}),
        DayRow(2, 2, "v4", {"add": 300, "subtract": 300}, {"add": 36, "subtract": 294}, 9400, 39.0, cycle="c3",
               outcome="promoted", why="new_failures 0.000 -> 0.104 >= delta 5.0 pts", usd=0.002, new_before=0.0,
               new_after=0.104, production={"add": 0.90, "subtract": 0.08}, final={"add": 0.92, "subtract": 0.10},
               ipd=1166.0, serve_usd_per_m=0.012, cycle_s=70.0),
    ]


@pytest.fixture()
def demo(tmp_path):
    """A finished fake demo: its ledger (three cycles' training, serving and the baseline eval,
    untagged), its final-test cycles file, its rows and summary."""
    (tmp_path / "hw.yaml").write_text(yaml.safe_dump(TOY))
    ledger = Ledger(tmp_path / "ledger.jsonl", catalog=load_catalog(tmp_path / "hw.yaml"))
    ledger.record("eval", hardware="toy-cpu", seconds=1.5, tokens_generated=1000, extra={"what": "v1"})
    for c, seconds in (("c1", 4.0), ("c2", 3.0), ("c3", 2.0)):
        ledger.record("sft", hardware="toy-cpu", seconds=seconds, tokens_trained=10_000, cycle=c)
    for day in (1, 2, 3):
        ledger.record("serve", hardware="toy-cpu", seconds=1.0, tokens_served=9000, extra={"day": day})
    finals = [CycleOutcome(cycle="c1", accuracy_before=0.44, accuracy_after=0.44, promoted=False),
              CycleOutcome(cycle="c2", accuracy_before=0.44, accuracy_after=0.455, promoted=True),
              CycleOutcome(cycle="c3", accuracy_before=0.455, accuracy_after=0.51, promoted=True)]
    (tmp_path / "final-test-cycles.jsonl").write_text("".join(o.model_dump_json() + "\n" for o in finals))
    world = WorldConfig(weeks=2, days_per_week=2, families=WorldConfig().families[:2])
    summary = summarize(rows(), world, {"add": 0.82, "subtract": 0.0}, {"add": 0.88, "subtract": 0.0},
                        seconds=600.0, base_build_s=312.0)
    return SimpleNamespace(ledger=ledger, outcomes_path=tmp_path / "cycles.jsonl"), summary


def test_the_table_is_printed_unwrapped_and_written(tmp_path):
    table = markdown_table(rows())
    assert sum(len(line) > 80 for line in table.splitlines()) == 4  # the header and each row would wrap at 80
    out = io.StringIO()
    path = write_table(table, tmp_path, Console(file=out, width=80, soft_wrap=True))
    assert out.getvalue() == table + "\n"  # not wrapped, not cut, no markup read ("[sic]" kept)
    assert path == tmp_path / "demo-table.md" and path.read_text() == table + "\n"
    assert "| c1 | rejected | " + WHY_REJECTED + " | 0.0040 |" in table


def test_the_closing_line_says_apart_the_base_build():
    s = {"seconds": 600.0, "base_build_s": 312.0, "per_family": {}, "new_family_before": 0.0,
         "new_family_after": 0.1, "old_delta": 1.0, "final_new_family_before": 0.0, "final_new_family_after": 0.1,
         "final_old_delta": 2.0, "points_per_usd": 100.0, "cycles": 3, "promoted": 2, "fix_latency_s": 95.0,
         "cycle_s": 50.0, "old_kl": 0.0123}
    assert summary_lines(s)[0].startswith(
        "demo took 10.0 min, after 5.2 min building its base model (first run only: cached for later runs);")
    assert summary_lines({**s, "base_build_s": 0.0})[0].startswith(
        "demo took 10.0 min (its base model came from the cache);")
    assert summary_lines(s)[-1].endswith(" fix_latency_s=95 cycle_s=50 old_kl=0.0123")


def test_fix_latency_is_the_median_over_new_families_and_inf_while_one_is_unfixed(demo):
    _, summary = demo
    assert summary["fix_latency"] == {"subtract": 95.0} and summary["fix_latency_s"] == 95.0
    assert summary["cycle_s"] == 50.0  # the median of the cycles that trained: 0 (c1's row default), 50 and 70
    week3 = DayRow(3, 1, "v5", {"multiply": 300}, {"multiply": 300}, 9000, 40.0, cycle="c4", outcome="rejected",
                   production={"add": 0.9, "subtract": 0.1, "multiply": 0.0},
                   final={"add": 0.9, "subtract": 0.1, "multiply": 0.0})
    start = {"add": 0.82, "subtract": 0.0, "multiply": 0.0}  # multiply arrives in week 3 and nothing fixes it
    assert summarize(rows() + [week3], WorldConfig(weeks=3), start, start, seconds=1.0)["fix_latency_s"] == float("inf")


def test_the_report_page_is_the_demos(demo, tmp_path):
    fw, summary = demo
    console_out = io.StringIO()
    _write_report(fw, tmp_path, rows(), Console(file=console_out, width=80, soft_wrap=True), summary)
    report = tmp_path / "report"
    page = (report / "index.html").read_text()
    assert "<title>flywheel demo report</title>" in page and "economics report</title>" not in page
    # the summary: time with the base build apart, cycles, and points per dollar of the cycles
    assert "demo took 10.0 min, after 5.2 min building its base model" in page
    assert "3 cycles, 2 promoted" in page
    assert "+7.0 final-test points (mean over families) for $0.0090 of cycles = 778 points per dollar" in page
    # the per-day table: outcomes and the gate's reasons, and the link to the same table as markdown
    assert "<th>outcome</th><th>why</th>" in page
    assert '<td class="text">rejected</td><td class="text">' + html.escape(WHY_REJECTED) + "</td>" in page
    assert '<a href="demo-table.md">demo-table.md</a>' in page and (report / "demo-table.md").exists()
    assert page.index("Day by day") < page.index("<h2>Economics</h2>") < page.index("Cycles: intelligence per dollar")
    # the economics table's accuracy column is the final test's mean, and says so
    assert "<th>final test (mean over families)</th>" in page and "<th>gated eval</th>" not in page
    assert "<td>44.0% → 45.5%</td>" in page
    # the total: the cycles (sft 9 s) plus serving (3 s) and the baseline eval (1.5 s), at $0.001 a second
    assert "7 ledger records, $0.0135 in all" in page
    assert ("of which $0.0090 in the 3 cycles (what points per dollar divide by) and $0.0045 outside any cycle: "
            "serve $0.0030, eval $0.0015") in page
    # the console: the unwrapped table and where everything is
    printed = console_out.getvalue()
    assert markdown_table(rows()) in printed and "index.html, demo-table.md, families.png" in printed


def test_the_cumulative_plot_says_which_accuracy_it_counts(demo, tmp_path):
    fw, _ = demo
    outcomes = [CycleOutcome(cycle="c1", accuracy_before=0.4, accuracy_after=0.5)]
    fig = cumulative_figure(build_report(fw.ledger.read(), outcomes, eval_name="final test (mean over families)"))
    ax = fig.axes[0]
    assert "points on the final test (mean over families)" in ax.get_title()
    default = cumulative_figure(build_report(fw.ledger.read(), outcomes)).axes[0]
    assert "points on the gated eval" in default.get_title()


def _legend_clear_of_axes(fig) -> bool:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.canvas.draw()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent()
    return not legend.overlaps(ax.get_window_extent()) and legend.x0 >= 0 and legend.y0 >= 0 \
        and legend.x1 <= fig.bbox.x1 and legend.y1 <= fig.bbox.y1  # outside the axes, inside the picture


def test_legends_cover_no_data(demo):
    fw, _ = demo
    assert _legend_clear_of_axes(family_figure(rows()))
    records = fw.ledger.read() + [r.model_copy(update={"stage": "eval"}) for r in fw.ledger.read() if r.cycle]
    assert _legend_clear_of_axes(cost_by_cycle_figure(build_report(records)))
