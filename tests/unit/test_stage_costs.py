"""What the cycle records per training stage (the RL split), and the report page's plots
(the demo's families.png on the page, next to the report's own)."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import yaml

from flywheel.economics import Ledger, load_catalog
from flywheel.economics.render import write_report
from flywheel.economics.tables import build_report
from flywheel.loop.cycle import train_cost_entries

TOY = {"version": 1, "as_of": "2026-01-01", "hardware": [{
    "name": "toy-cpu", "kind": "cpu", "unit": "1 device", "usd_per_hour": 3.6, "peak_tflops": 1.0,
    "precision": "fp32", "memory_bandwidth_gb_s": 10.0, "memory_gb": 8.0, "sources": ["by hand"]}]}


@pytest.fixture()
def ledger(tmp_path):
    path = tmp_path / "hw.yaml"
    path.write_text(yaml.safe_dump(TOY))
    return Ledger(tmp_path / "ledger.jsonl", catalog=load_catalog(path))


def test_sft_and_dpo_record_trained_tokens():
    result = SimpleNamespace(tokens_trained=120)
    assert train_cost_entries("sft", 3.0, result) == [("sft", 3.0, {"tokens_trained": 120})]
    assert train_cost_entries("dpo", 2.0, result) == [("dpo", 2.0, {"tokens_trained": 120})]


def test_rl_is_split_into_rollouts_and_training_that_add_up_to_the_stage():
    result = SimpleNamespace(tokens_trained=300, tokens_generated=400, rollout_seconds=6.0)
    assert train_cost_entries("rl", 10.0, result) == [
        ("rl_rollout", 6.0, {"tokens_generated": 400}), ("rl_train", 4.0, {"tokens_trained": 300})]
    # waits measured a hair over the stage's own clock never make a negative record
    over = SimpleNamespace(tokens_trained=1, tokens_generated=1, rollout_seconds=10.5)
    assert [s for _, s, _ in train_cost_entries("rl", 10.0, over)] == [10.0, 0.0]


def test_training_and_eval_are_priced_per_million_tokens(ledger):
    # toy-cpu: $0.001 per second. sft 10 s, 2e5 trained -> $0.05 per 1M; eval 4 s, 1e4 generated
    # -> $0.40 per 1M; rl 6 s of rollouts for 3e4 generated -> $0.20 per 1M
    for stage, seconds, tokens in (("sft", 10, {"tokens_trained": 200_000}),
                                   ("eval", 4, {"tokens_generated": 10_000}),
                                   ("rl_rollout", 6, {"tokens_generated": 30_000})):
        ledger.record(stage, hardware="toy-cpu", seconds=seconds, cycle="c1", **tokens)
    fams = {f.family: f for f in build_report(ledger.read()).families}
    assert fams["training"].usd_per_million == pytest.approx(0.05)
    assert fams["eval"].usd_per_million == pytest.approx(0.40)
    assert fams["rollouts"].usd_per_million == pytest.approx(0.20)


def test_extra_plots_are_written_and_shown_on_the_page(ledger, tmp_path):
    ledger.record("serve", hardware="toy-cpu", seconds=1, tokens_served=10)
    png = b"\x89PNG\r\n\x1a\nfamilies"
    paths = write_report(build_report(ledger.read()), tmp_path / "out", extra_plots={"families.png": png})
    assert paths["families.png"].read_bytes() == png
    page = paths["index.html"].read_text()
    assert "<figcaption>families.png</figcaption>" in page and 'alt="families"' in page
    assert page.index("families.png") < page.index("cost_per_million.png")  # first on the page
    with pytest.raises(ValueError, match="cost_per_million.png"):
        write_report(build_report(ledger.read()), tmp_path / "x", extra_plots={"cost_per_million.png": png})
    with pytest.raises(ValueError, match="plain file names"):
        write_report(build_report(ledger.read()), tmp_path / "x", extra_plots={"../f.png": png})


def test_demo_report_page_embeds_the_family_plot(ledger, tmp_path):
    from rich.console import Console

    from flywheel.demo.run import DayRow, _write_report

    ledger.record("serve", hardware="toy-cpu", seconds=2, tokens_served=100)
    rows = [DayRow(1, d, "v1", {"add": 4}, {"add": 1}, 100, 2.0, cycle=f"c{d}", outcome="promoted",
                   production={"add": 0.5 + d / 10}) for d in (1, 2)]
    fw = SimpleNamespace(ledger=ledger, outcomes_path=tmp_path / "cycles.jsonl")
    _write_report(fw, tmp_path, rows, Console(file=io.StringIO()))
    report = tmp_path / "report"
    assert (report / "families.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (report / "index.html").read_text()
    assert "<figcaption>families.png</figcaption>" in page
