"""The flagship demo, reduced: a smaller base model, two weeks of one day each, few episodes.
It checks the machinery end to end (HTTP traffic recorded as traces, feedback, cycles, the
table, the plots and the last line), not the learning figures, which need the full budget."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("uvicorn")

from flywheel.demo import base as demo_base

SMALL_BASE = demo_base.BaseRecipe(hidden=32, layers=1, heads=2, ffn=64, demos=200, steps=60, batch=8, lr=3e-3,
                                  warmup=5, digits=(3,))


@pytest.mark.slow  # the demo end to end (minutes of training and serving): make test-all
def test_reduced_demo_runs_end_to_end(tmp_path, monkeypatch, capsys):
    from typer.main import get_command

    from flywheel.cli.main import app
    from flywheel.registry import Registry
    from flywheel.traces.store import TraceStore

    monkeypatch.setenv("FLYWHEEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(demo_base, "BASE_RECIPE", SMALL_BASE)
    out = tmp_path / "demo"
    get_command(app).main(["demo", "--out", str(out), "--weeks", "2", "--days", "1", "--episodes", "24",
                           "--sft-steps", "4", "--rl-steps", "1", "--eval-tasks", "8", "--correction-rate", "1.0",
                           "--min-new-failures", "1",  # 24 episodes a day hold a few new failures
                           "--final-tasks", "8"],
                          standalone_mode=False)
    lines = capsys.readouterr().out.strip().splitlines()
    m = re.fullmatch(r"demo: new_family_before=(\S+) new_family_after=(\S+) old_delta=(\S+) "
                     r"final_new_family_before=(\S+) final_new_family_after=(\S+) final_old_delta=(\S+) "
                     r"points_per_usd=(\S+) cycles=2 promoted=(\d) fix_latency_s=(\S+) cycle_s=(\S+) "
                     r"old_kl=(\S+)", lines[-1])
    assert m, lines[-1]
    assert all(0.0 <= float(m.group(i)) <= 1.0 for i in (1, 2, 4, 5))
    assert float(m.group(11)) >= 0.0  # old_kl: a KL is never negative (0 when production is the base)
    # the final test: one economics line per cycle, production's mean before and after it
    import json

    finals = [json.loads(x) for x in (out / "final-test-cycles.jsonl").read_text().splitlines()]
    assert [f["cycle"] for f in finals] == ["c1", "c2"]
    assert all(f["accuracy_before"] == f["accuracy_after"] for f in finals if not f["promoted"])
    # every request became a trace; every episode got an outcome, every failure a correction
    with TraceStore(f"sqlite:///{out / 'traces.db'}") as store:
        traces = list(store.iter_traces())
        assert len(traces) >= 48 and {t.source for t in traces} == {"serve"}
        outcomes = [f for t in traces for f in t.feedback if f.score is not None]
        assert len(outcomes) == 48 and all(f.verifier and f.verifier.env == "calculator" for f in outcomes)
        failed = sum(f.score == 0.0 for f in outcomes)
        assert sum(f.correction is not None for t in traces for f in t.feedback) == failed
    with Registry(out / "registry") as reg:
        assert reg.get("v1").status in ("production", "archived")
    states = sorted((out / "cycles").glob("c*/state.json"))
    assert [p.parent.name for p in states] == ["c1", "c2"]
    report = out / "report"
    assert (report / "families.png").stat().st_size > 1000 and (report / "index.html").exists()
    table = (report / "demo-table.md").read_text().splitlines()
    assert table[0].startswith("| week | day | served | traffic | add failed") and len(table) == 4
    # every stage recorded the tokens it processed, the baseline evaluation of v1 included
    from flywheel.economics.ledger import read_ledger

    records = read_ledger(out / "ledger.jsonl")
    evals = [r for r in records if r.stage == "eval"]
    assert evals[0].extra["what"] == "v1 before the first week" and all(r.tokens_generated > 0 for r in evals)
    stages = [(r.stage, r.tokens_trained, r.tokens_generated) for r in records]
    assert all(r.tokens_trained > 0 for r in records if r.stage == "sft"), stages
    rollouts = [r for r in records if r.stage == "rl_rollout"]  # one RL step may train nothing (flat groups)
    assert rollouts and all(r.tokens_generated > 0 for r in rollouts), stages
    assert all(r.tokens_served > 0 for r in records if r.stage == "serve")
    assert "<figcaption>families.png</figcaption>" in (report / "index.html").read_text()  # embedded


def test_base_recipe_key_is_the_hash_of_its_fields():
    """The cache folder of the base model is named by its recipe's fields, the split rule its
    demos were drawn under included (envs/splits.py): any field changes it."""
    import dataclasses
    import hashlib
    import json

    recipe = demo_base.BaseRecipe()
    fields = {"hidden": 64, "layers": 2, "heads": 4, "ffn": 256, "demos": 4500, "steps": 3000, "batch": 16,
              "lr": 3e-3, "warmup": 30, "family": demo_base.FAMILIES[0].settings, "digits": [2, 3, 4],
              "split_rule": "sha256-prefix-8B/test<0.2", "template": "compact", "tools_share": 0.5, "seed": 2,
              "stop_at": 0.95, "phrasings": list(demo_base.ADD_PHRASINGS)}
    assert recipe.key() == hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
    # "933f17bef0a5" before the hash split, "bf3bc74d5e4f" before the demos offered tools,
    # "c30f179e8a44" before the eight phrasings: not reused
    assert recipe.key() == "df54807bc6d8"
    assert dataclasses.replace(recipe, steps=3001).key() != recipe.key()
    assert SMALL_BASE.key() != recipe.key()
