"""The demo's general-ability measure for a pretrained base (demo/general.py) and the CLI's
choice of base (demo/presets.py)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from flywheel.demo.general import SIMPLE_QUESTIONS, Probe, answered_right


def test_an_answer_is_right_when_it_contains_an_accepted_answer():
    assert answered_right("The capital of France is Paris.", ("paris",))
    assert answered_right("A spider has 8 legs", ("eight", "8"))
    assert not answered_right("I am not sure.", ("paris",))


def test_every_simple_question_has_an_accepted_answer_in_lower_case():
    assert all(accepted and all(a == a.lower() for a in accepted) for _, accepted in SIMPLE_QUESTIONS)


def test_the_base_against_itself_has_zero_kl_and_loses_nothing(tmp_path):
    from flywheel.models import TinySpec, build_tiny_model

    base = build_tiny_model(tmp_path / "m", TinySpec(hidden=32, layers=1, heads=2, ffn=64))
    probe = Probe.measure(base, tmp_path / "general")
    assert len(probe.rows.read_text().splitlines()) == 16
    same = probe.compare(base)
    assert same["general_kl"] == pytest.approx(0.0, abs=1e-6)
    assert same["simple_kept"] == same["simple_right_before"] == len(probe.right)


def test_the_demo_refuses_an_unknown_base_by_name(tmp_path):
    from flywheel.cli.main import app

    result = CliRunner().invoke(app, ["demo", "--out", str(tmp_path / "d"), "--base", "gpt-17"])
    assert result.exit_code == 2 and "--base" in result.output and "smollm2-135m-instruct" in result.output
    assert not (tmp_path / "d").exists()  # refused before anything ran


def test_the_anchor_prompts_are_none_of_the_measured_ones():
    from flywheel.demo.general import ANCHOR_PROMPTS, GENERAL_PROMPTS

    measured = set(GENERAL_PROMPTS) | {q for q, _ in SIMPLE_QUESTIONS}
    assert len(set(ANCHOR_PROMPTS)) == len(ANCHOR_PROMPTS) == 96 and not measured & set(ANCHOR_PROMPTS)


def test_the_self_anchor_is_the_bases_own_answers(tmp_path):
    import json

    from flywheel.demo.general import ANCHOR_PROMPTS, CHAT_TOKENS, _greedy, self_anchor
    from flywheel.models import TinySpec, build_tiny_model

    base = build_tiny_model(tmp_path / "m", TinySpec(hidden=32, layers=1, heads=2, ffn=64))
    rows = [json.loads(line) for line in self_anchor(base, tmp_path / "a" / "rows.jsonl").read_text().splitlines()]
    assert [r["messages"][0]["content"] for r in rows] == list(ANCHOR_PROMPTS)
    assert [r["messages"][1]["content"] for r in rows] == _greedy(base, list(ANCHOR_PROMPTS), CHAT_TOKENS)
