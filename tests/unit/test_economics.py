"""Economics: catalog, ledger, cost per token, intelligence per dollar, projection, report, CLI.

Numbers are worked out by hand in the comments. The toy catalog keeps them round:
toy-cpu costs $3.60/h = $0.001 per device-second and peaks at 1 TFLOP/s;
toy-gpu costs $7.20/h = $0.002 per device-second and peaks at 1000 TFLOP/s.
"""

from __future__ import annotations

import json
import threading

import pytest
import yaml
from typer.testing import CliRunner

from flywheel.cli.main import app
from flywheel.economics import (CatalogError, CycleOutcome, Ledger, LedgerError, LedgerWarning, compute_usd,
                                cost_by_family, cumulative_curve, cycle_rows, intelligence_per_dollar,
                                load_catalog, make_record, read_ledger)
from flywheel.economics.catalog import SHIPPED, parse_catalog
from flywheel.economics.projection import estimate_seconds, measured_mfu, project
from flywheel.economics.render import write_report
from flywheel.economics.tables import build_report


def entry(name, kind="gpu", **kw):
    e = {"name": name, "kind": kind, "unit": "1 device", "usd_per_hour": 7.2, "peak_tflops": 1000.0,
         "precision": "bf16 dense", "memory_bandwidth_gb_s": 1000.0, "memory_gb": 80.0, "sources": ["by hand"]}
    e.update(kw)
    return e


TOY = {"version": 1, "as_of": "2026-01-01", "hardware": [
    entry("toy-cpu", "cpu", usd_per_hour=3.6, peak_tflops=1.0),
    entry("toy-gpu")]}


@pytest.fixture()
def toy(tmp_path):
    path = tmp_path / "hw.yaml"
    path.write_text(yaml.safe_dump(TOY))
    return load_catalog(path), path


def write_catalog(tmp_path, hardware):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "hardware": hardware}))
    return path


# ---------------------------------------------------------------- catalog


def test_shipped_catalog_loads_with_every_required_entry():
    cat = load_catalog()
    assert cat.path == SHIPPED
    assert cat.names() == ["cpu-2core", "h100-sxm", "h200", "b200", "gb200-nvl72", "vera-rubin-nvl144"]
    assert cat.get("cpu-2core").kind == "cpu" and all(h.kind == "gpu" for h in list(cat)[1:])
    assert [h.name for h in cat if h.projection] == ["vera-rubin-nvl144"]
    assert all(h.sources and h.usd_per_hour > 0 and h.peak_flops > 0 for h in cat)
    # the NVL72 entry is per GPU; a rack is 72 of them
    gb = cat.get("gb200-nvl72")
    assert gb.system.devices == 72 and gb.system_usd_per_hour == pytest.approx(72 * gb.usd_per_hour)
    # lookup: exact, alias, any case, unique prefix
    assert cat.get("H100").name == "h100-sxm" and cat.get("GB200").name == "gb200-nvl72"
    assert cat.get("rubin").name == "vera-rubin-nvl144" and cat.get("B2").name == "b200"
    with pytest.raises(CatalogError, match="unknown hardware 'h'.*known: cpu-2core"):
        cat.get("h")  # ambiguous prefix: h100-sxm, h200
    with pytest.raises(CatalogError, match="unknown hardware 'tpu'"):
        cat.get("tpu")


def test_user_catalog_by_path_and_by_env_var(toy, monkeypatch):
    _, path = toy
    assert load_catalog(path).names() == ["toy-cpu", "toy-gpu"]
    monkeypatch.setenv("FLYWHEEL_HARDWARE", str(path))
    assert load_catalog().names() == ["toy-cpu", "toy-gpu"]
    assert load_catalog(SHIPPED).get("h100").name == "h100-sxm"  # an explicit path wins


@pytest.mark.parametrize("bad, expected", [
    (entry("bad-gpu", usd_per_hour=-1), r"entry 1 \(bad-gpu\): field usd_per_hour: .*greater than 0"),
    (entry("bad-gpu", price=3), r"entry 1 \(bad-gpu\): field price: Extra inputs are not permitted"),
    (entry("bad-gpu", kind="tpu"), r"entry 1 \(bad-gpu\): field kind: "),
    (entry("bad-gpu", sources=[]), r"entry 1 \(bad-gpu\): field sources: "),
    ({k: v for k, v in entry("bad-gpu").items() if k != "peak_tflops"}, r"entry 1 \(bad-gpu\): field peak_tflops: Field required"),
    (entry("bad-gpu", system={"name": "rack", "devices": 0}), r"entry 1 \(bad-gpu\): field system.devices: "),
    (entry("toy-cpu"), r"entry 1 \(toy-cpu\): field name: duplicate name"),
    ("just a string", r"entry 1: expected a mapping"),
])
def test_bad_catalog_error_names_file_entry_and_field(tmp_path, bad, expected):
    path = write_catalog(tmp_path, [entry("toy-cpu", "cpu"), bad])
    with pytest.raises(CatalogError, match=str(path).replace(".", r"\.") + ": " + expected):
        load_catalog(path)


def test_bad_catalog_file_level_errors(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("hardware: [\n")
    with pytest.raises(CatalogError, match="x.yaml: not valid YAML"):
        load_catalog(p)
    p.write_text("- 1\n")
    with pytest.raises(CatalogError, match="x.yaml: expected a mapping"):
        load_catalog(p)
    p.write_text("hardware: []\nvendor: x\n")
    with pytest.raises(CatalogError, match="x.yaml: field hardware: "):
        load_catalog(p)
    with pytest.raises(CatalogError, match="missing.yaml: cannot read"):
        load_catalog(tmp_path / "missing.yaml")
    with pytest.raises(CatalogError, match="alias 'GPU' is used by both 'a' and 'b'"):
        parse_catalog({"hardware": [entry("a", aliases=["gpu"]), entry("b", aliases=["GPU"])]})


# ---------------------------------------------------------------- ledger


def test_compute_usd_is_device_seconds_times_price():
    # 2 devices x 90 s x $7.20/h / 3600 = 180 device-s x $0.002 = $0.36
    assert compute_usd(2, 90, 7.2) == pytest.approx(0.36)


def test_ledger_append_read_round_trip(toy, tmp_path):
    cat, _ = toy
    path = tmp_path / "data" / "ledger.jsonl"
    led = Ledger(path, catalog=cat)
    a = led.record("rl_rollout", hardware="toy-gpu", devices=2, seconds=90, cycle="c1", run="r1",
                   tokens_generated=1234, params=10**9, extra={"group_size": 8})
    b = led.record("curation", hardware="toy-cpu", seconds=5, usd=0.25)  # usd given: kept, no price
    assert a.usd == pytest.approx(0.36) and a.usd_per_hour == 7.2
    assert b.usd == 0.25 and b.usd_per_hour is None
    assert len(path.read_text().splitlines()) == 2
    assert read_ledger(path) == [a, b] == led.read() == led.records
    # the price is frozen in the record: editing the catalog later changes nothing
    assert json.loads(path.read_text().splitlines()[0])["usd_per_hour"] == 7.2
    with pytest.raises(CatalogError, match="unknown hardware 'tpu'"):
        led.record("sft", hardware="tpu", seconds=1)
    with pytest.raises(LedgerError, match="field seconds"):
        led.record("sft", hardware="toy-cpu", seconds=-1)
    with pytest.raises(LedgerError, match="field stage"):
        make_record("SFT stage", hardware="toy-cpu", seconds=1, usd=0.0)


def test_a_keyed_record_is_appended_once_in_a_file_or_in_memory(toy, tmp_path):
    cat, _ = toy
    path = tmp_path / "ledger.jsonl"
    path.write_text('{"torn": \n')  # a corrupt line holds no key and stops nothing
    for led in (Ledger(path, catalog=cat), Ledger(path, catalog=cat), Ledger(None, catalog=cat)):
        for seconds in (10, 20):  # the same stage retried
            led.record("eval", hardware="toy-cpu", seconds=seconds, cycle="c1", key="c1/eval")
        led.record("eval", hardware="toy-cpu", seconds=30, cycle="c2", key="c2/eval")
        led.record("curation", hardware="toy-cpu", seconds=1)  # no key: always appended
    keyed = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    assert [(r["key"], r["seconds"]) for r in keyed] == [("c1/eval", 10.0), ("c2/eval", 30.0), (None, 1.0), (None, 1.0)]
    assert [r.seconds for r in led.records] == [10.0, 30.0, 1.0]  # the in-memory ledger, alike


def test_stage_context_manager_times_the_block(toy, monkeypatch):
    cat, _ = toy
    led = Ledger(catalog=cat)  # in memory
    clock = iter([100.0, 130.0, 200.0, 210.0])
    monkeypatch.setattr("flywheel.economics.ledger.time.perf_counter", lambda: next(clock))
    with led.stage("rl_train", hardware="toy-cpu", cycle="c1", params=7) as rec:
        rec.tokens_trained += 500
        rec.tokens_trained += 250
    # 30 s x $3.60/h / 3600 = $0.03
    r = rec.record
    assert (r.seconds, r.tokens_trained, r.cycle, r.params) == (30.0, 750, "c1", 7)
    assert r.usd == pytest.approx(0.03)
    with pytest.raises(RuntimeError):
        with led.stage("eval", hardware="toy-gpu") as rec2:
            raise RuntimeError("boom")
    # the devices were held for 10 s all the same: recorded, with the error named
    assert rec2.record.extra == {"error": "RuntimeError"} and rec2.record.usd == pytest.approx(0.02)
    assert [x.stage for x in led.read()] == ["rl_train", "eval"]
    with pytest.raises(CatalogError):  # checked before the block runs
        with led.stage("eval", hardware="nope"):
            pass


def test_corrupt_line_is_reported_with_its_line_number(toy, tmp_path):
    cat, _ = toy
    path = tmp_path / "l.jsonl"
    good = make_record("sft", hardware="toy-cpu", seconds=1, catalog=cat).to_json()
    bad_record = json.dumps({**json.loads(good), "seconds": -3})
    path.write_text(f"{good}\n{{not json\n\n{bad_record}\n{good}\n")
    with pytest.raises(LedgerError, match=r"l\.jsonl:2: not a valid record"):
        read_ledger(path)
    with pytest.warns(LedgerWarning) as w:
        recs = read_ledger(path, skip_corrupt=True)
    assert len(recs) == 2
    msgs = [str(x.message) for x in w]
    assert len(msgs) == 2 and "l.jsonl:2:" in msgs[0] and "l.jsonl:4: field seconds" in msgs[1]
    with pytest.raises(LedgerError, match="no such ledger file"):
        read_ledger(tmp_path / "none.jsonl")


def test_append_after_a_torn_last_line_keeps_records_apart(toy, tmp_path):
    cat, _ = toy
    path = tmp_path / "l.jsonl"
    path.write_text('{"stage": "sft", "hardw')  # a writer died mid-line
    led = Ledger(path, catalog=cat)
    rec = led.record("sft", hardware="toy-cpu", seconds=2)
    with pytest.raises(LedgerError, match=r"l\.jsonl:1:"):
        read_ledger(path)
    with pytest.warns(LedgerWarning, match=r"l\.jsonl:1:"):
        assert read_ledger(path, skip_corrupt=True) == [rec]


def test_concurrent_appends_never_interleave(toy, tmp_path):
    cat, _ = toy
    path = tmp_path / "l.jsonl"

    def work(i):
        led = Ledger(path, catalog=cat)  # one writer object each: only O_APPEND + flock keep lines whole
        for j in range(50):
            led.record("rl_rollout", hardware="toy-cpu", seconds=0.001, run=f"t{i}",
                       tokens_generated=j, extra={"pad": "x" * 500})

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    recs = read_ledger(path)  # raises on any torn line
    assert len(recs) == 200 and {r.run for r in recs} == {"t0", "t1", "t2", "t3"}


# ---------------------------------------------------------------- reports


def toy_records(cat):
    def rec(stage, hw, seconds, **kw):
        return make_record(stage, hardware=hw, seconds=seconds, catalog=cat, **kw)

    return [
        rec("serve", "toy-gpu", 100, devices=2, tokens_served=200_000),     # $0.40
        rec("rl_rollout", "toy-cpu", 1000, cycle="c1", tokens_generated=250_000),  # $1.00
        rec("rl_train", "toy-cpu", 500, cycle="c1", tokens_trained=1_000_000),     # $0.50
        rec("eval", "toy-cpu", 100, cycle="c1", tokens_generated=20_000),          # $0.10
        rec("rl_train", "toy-cpu", 2000, cycle="c2", tokens_trained=100),          # $2.00
        rec("sft", "toy-cpu", 500, cycle="c3", tokens_trained=1_000),              # $0.50
        make_record("curation", hardware="toy-cpu", seconds=1, usd=0.25),          # $0.25, no tokens
    ]


OUTCOMES = [
    CycleOutcome(cycle="c1", accuracy_before=0.40, accuracy_after=0.55),                 # +15 points
    CycleOutcome(cycle="c2", accuracy_before=0.55, accuracy_after=0.50, promoted=False),  # -5, rejected
    CycleOutcome(cycle="c3", accuracy_before=0.50, accuracy_after=0.49),                 # -1, promoted
    CycleOutcome(cycle="c4", accuracy_before=0.49, accuracy_after=0.60),                 # no cost recorded
]


def test_cost_per_million_tokens_by_family(toy):
    cat, _ = toy
    fam = {f.family: f for f in cost_by_family(toy_records(cat))}
    assert list(fam) == ["serving", "rollouts", "training", "eval", "curation"]
    # serving: 2 x 100 s x $0.002 = $0.40 for 200,000 served -> $0.40 / 0.2M = $2.00 per 1M
    assert fam["serving"].usd == pytest.approx(0.40) and fam["serving"].usd_per_million == pytest.approx(2.0)
    # rollouts: 1000 s x $0.001 = $1.00 for 250,000 generated -> $4.00 per 1M
    assert fam["rollouts"].usd_per_million == pytest.approx(4.0)
    # training: $0.50 + $2.00 + $0.50 = $3.00 for 1,001,100 trained -> $2.99670... per 1M
    assert fam["training"].tokens == 1_001_100
    assert fam["training"].usd_per_million == pytest.approx(3.0 / 1.0011)
    # eval: $0.10 for 20,000 generated -> $5.00 per 1M; curation has no tokens
    assert fam["eval"].usd_per_million == pytest.approx(5.0)
    assert fam["curation"].usd == 0.25 and fam["curation"].usd_per_million is None
    assert fam["serving"].device_hours == pytest.approx(200 / 3600)


def test_intelligence_per_dollar_edge_cases():
    assert intelligence_per_dollar(15.0, 1.6).value == pytest.approx(9.375)  # 15 / 1.6
    zero = intelligence_per_dollar(3.0, 0.0)
    assert zero.value is None and "no cost" in zero.note  # never infinity
    neg = intelligence_per_dollar(-1.0, 0.5)
    assert neg.value == pytest.approx(-2.0) and "negative" in neg.note  # never clipped
    assert intelligence_per_dollar(0.0, 2.0).value == 0.0
    with pytest.raises(ValueError):
        intelligence_per_dollar(1.0, -1.0)


def test_cycle_rows_and_cumulative_curve(toy):
    cat, _ = toy
    rows = {r.cycle: r for r in cycle_rows(toy_records(cat), OUTCOMES)}
    assert list(rows) == ["c1", "c2", "c3", "c4"]
    # c1: $1.00 + $0.50 + $0.10 = $1.60; 0.40 -> 0.55 = +15 points, promoted -> 15 / 1.6 = 9.375 pts/$
    assert rows["c1"].usd == pytest.approx(1.6) and rows["c1"].ipd.value == pytest.approx(9.375)
    assert rows["c1"].usd_by_stage == pytest.approx({"rl_rollout": 1.0, "rl_train": 0.5, "eval": 0.1})
    # c2: gate rejected a -5 candidate: production gained 0 points for $2.00 -> 0 pts/$
    assert rows["c2"].outcome.gain_points == pytest.approx(-5) and rows["c2"].ipd.value == 0.0
    # c3: promoted at -1 point for $0.50 -> -2 pts/$, kept negative
    assert rows["c3"].ipd.value == pytest.approx(-2.0)
    # c4: an outcome but nothing in the ledger: undefined, not infinite
    assert rows["c4"].usd == 0.0 and rows["c4"].ipd.value is None
    curve = cumulative_curve(list(rows.values()))
    flat = [v for point in curve for v in point]
    assert flat == pytest.approx([0, 0, 1.6, 15, 3.6, 15, 4.1, 14, 4.1, 25])
    # a cycle in the ledger without an outcome adds cost and no points
    only_ledger = cycle_rows(toy_records(cat), [])
    assert [r.ipd for r in only_ledger] == [None, None, None]
    assert list(cumulative_curve(only_ledger)[-1]) == pytest.approx([4.1, 0.0])


def test_projection_against_hand_worked_numbers(toy):
    cat, _ = toy
    gpu = cat.get("toy-gpu")
    P = 10**9
    recs = [make_record("rl_rollout", hardware="toy-cpu", seconds=1000, catalog=cat, params=P, tokens_generated=10**6),
            make_record("rl_train", hardware="toy-cpu", seconds=2000, catalog=cat, params=P, tokens_trained=10**6),
            make_record("serve", hardware="toy-cpu", seconds=500, catalog=cat, tokens_served=500_000),  # no params
            ]
    # at MFU 0.5 the toy GPU does 1000e12 x 0.5 = 5e14 FLOP/s and costs $0.002/s
    # rollouts: 2 x 1e9 x 1e6 = 2e15 FLOPs -> 4 s -> $0.008  ($0.008 per 1M generated)
    # training: 6 x 1e9 x 1e6 = 6e15 FLOPs -> 12 s -> $0.024
    p = project(recs, gpu, mfu=0.5)
    assert p.label == "estimate"
    assert p.flops == pytest.approx(8e15) and p.estimated_usd == pytest.approx(0.032)
    assert p.estimated_device_hours == pytest.approx(16 / 3600)
    assert (p.unprojected_records, p.unprojected_usd) == (1, pytest.approx(0.5))
    # measured: $1.00 + $2.00 = $3.00 -> the toy GPU would cost 0.032 / 3 of it
    assert p.measured_usd == pytest.approx(3.0) and p.ratio == pytest.approx(0.032 / 3)
    fam = {f.family: f for f in p.families}
    assert fam["rollouts"].estimated_usd == pytest.approx(0.008)
    assert fam["rollouts"].estimated_usd_per_million == pytest.approx(0.008)
    # serving with params from the argument: 2 x 1e9 x 5e5 = 1e15 FLOPs -> 2 s -> $0.004 more
    p2 = project(recs, gpu, mfu=0.5, params=P)
    assert p2.unprojected_records == 0 and p2.estimated_usd == pytest.approx(0.036)
    with pytest.raises(ValueError, match="mfu"):
        estimate_seconds(1.0, gpu, 0.0)


def test_measured_mfu_on_the_recorded_hardware(toy):
    cat, _ = toy
    # 1e6 tokens x 2 x 1e7 params = 2e13 FLOPs in 100 s on a 1 TFLOP/s device: 2e13 / 1e14 = 0.2
    r = make_record("rl_rollout", hardware="toy-cpu", seconds=100, catalog=cat, params=10**7, tokens_generated=10**6)
    assert measured_mfu([r], cat) == pytest.approx(0.2)
    assert measured_mfu([r.model_copy(update={"params": None})], cat) is None


# ---------------------------------------------------------------- report, HTML, CLI


def test_report_writes_png_and_self_contained_html(toy, tmp_path):
    cat, _ = toy
    rep = build_report(toy_records(cat), OUTCOMES, catalog=cat, targets=[cat.get("toy-gpu")], mfu=0.5, params=10**6)
    paths = write_report(rep, tmp_path / "out")
    pngs = sorted(n for n in paths if n.endswith(".png"))
    assert pngs == ["cost_by_cycle.png", "cost_per_million.png", "cumulative.png", "projection_estimate.png"]
    for n in pngs:
        assert paths[n].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = paths["index.html"].read_text()
    assert page.count("data:image/png;base64,") == 4
    assert "<link" not in page and "<script" not in page and 'src="http' not in page
    # the tables are in the page: serving at $2.00 per 1M, c1 at 9.38 points per dollar
    assert "Cost per 1M tokens by stage family" in page and "<td>$2.00</td>" in page
    assert "<td>9.38</td>" in page and "undefined: no cost recorded" in page
    assert "Projection on other hardware (ESTIMATE" in page and "est. USD" in page


@pytest.fixture()
def cli_files(toy, tmp_path):
    cat, cat_path = toy
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text("".join(r.to_json() + "\n" for r in toy_records(cat)))
    cycles = tmp_path / "cycles.jsonl"
    cycles.write_text("".join(o.model_dump_json() + "\n" for o in OUTCOMES))
    return cat_path, ledger, cycles, tmp_path / "report"


def test_cli_report(cli_files):
    cat_path, ledger, cycles, out = cli_files
    r = CliRunner().invoke(app, ["economics", "report", "--ledger", str(ledger), "--cycles", str(cycles),
                                 "--out", str(out), "--project", "TOY-GPU", "--catalog", str(cat_path),
                                 "--params", "1000000"])
    assert r.exit_code == 0, r.output
    assert "ESTIMATE" in r.stdout and "9.38" in r.stdout and "7 ledger records, $4.75" in r.stdout
    assert (out / "index.html").exists() and (out / "cumulative.png").exists()


def test_cli_errors_are_one_line_with_file_and_line(cli_files):
    cat_path, ledger, cycles, out = cli_files
    with ledger.open("a") as f:
        f.write("{oops\n")
    base = ["economics", "report", "--ledger", str(ledger), "--out", str(out), "--catalog", str(cat_path)]
    r = CliRunner().invoke(app, base)
    assert r.exit_code == 2 and "ledger.jsonl:8: not a valid record" in r.stderr
    r = CliRunner().invoke(app, [*base, "--skip-corrupt"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, [*base, "--skip-corrupt", "--project", "tpu"])
    assert r.exit_code == 2 and "unknown hardware 'tpu'" in r.stderr


def test_cli_hardware_lists_the_shipped_catalog():
    r = CliRunner().invoke(app, ["economics", "hardware"])
    assert r.exit_code == 0, r.output
    assert "h100-sxm" in r.stdout and "vera-rubin-nvl144" in r.stdout and "projection" in r.stdout
