"""The demo's general-ability measure for a pretrained base (demo/general.py) and the CLI's
choice of base (demo/presets.py)."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from flywheel.demo.general import SIMPLE_QUESTIONS, Probe, answered_right


def test_an_answer_is_right_when_its_first_sentence_holds_an_accepted_answer_as_a_word():
    assert answered_right("The capital of France is Paris.", ("paris",))
    assert answered_right("A spider has 8 legs", ("eight", "8"))
    assert answered_right("It boils at approximately 100.0 degrees Celsius. Then", ("100",))
    assert answered_right("It boils at 100 degrees. Then", ("100",))
    assert answered_right("Carbon dioxide, mostly!", ("carbon dioxide", "co2"))
    assert not answered_right("I am not sure.", ("paris",))
    # the base's two lucky hits of 2026-12-07: wrong first sentences, the word only later or inside another
    assert not answered_right("A year is approximately 365 days. So, 1 year is 365 * 12 = 312 months.", ("twelve", "12"))
    assert not answered_right("The planet we live on is called Kepler-41B. It's a terrestrial planet, similar to Earth",
                              ("earth",))
    assert not answered_right("It has 312 months", ("12",)) and not answered_right("Parisian food", ("paris",))
    assert answered_right("The answer:\nParis", ("answer",)) and not answered_right("The answer:\nParis", ("paris",))


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
    before = [json.loads(line) for line in (tmp_path / "general" / "simple-before.jsonl").read_text().splitlines()]
    after = [json.loads(line) for line in (tmp_path / "general" / "simple-after.jsonl").read_text().splitlines()]
    assert [b["question"] for b in before] == [q for q, _ in SIMPLE_QUESTIONS]
    assert [i for i, b in enumerate(before) if b["right"]] == list(probe.right)
    assert [a["question"] for a in after] == [q for q, _ in SIMPLE_QUESTIONS]  # every one asked again
    assert [a["right"] for a in after] == [b["right"] for b in before]
    assert same["simple_gained"] == 0 and same["simple_right_after"] == len(probe.right)
    assert same["simple_net_points_lost"] == 0 == same["simple_points_lost"] or not probe.right


def test_the_simple_figures_count_losses_one_sided_and_net():
    from flywheel.demo.general import simple_figures

    # 5 questions; the base had 0, 1, 3 right; now 1 and 2 are right: 0 and 3 lost, 2 gained
    got = simple_figures((0, 1, 3), [False, True, True, False, False])
    assert got == {"simple_right_before": 3.0, "simple_kept": 1.0, "simple_gained": 1.0, "simple_right_after": 2.0,
                   "simple_points_lost": pytest.approx(200 / 3), "simple_net_points_lost": pytest.approx(100 / 3)}
    gain = simple_figures((0,), [True, True, True])  # two gained: a net gain is a negative loss
    assert gain["simple_points_lost"] == 0 and gain["simple_net_points_lost"] == -200
    none = simple_figures((), [True, False])
    assert none["simple_gained"] == 1 and math.isnan(none["simple_points_lost"]) and math.isnan(none["simple_net_points_lost"])


def test_the_demo_refuses_an_unknown_base_by_name(tmp_path):
    from flywheel.cli.main import app

    result = CliRunner().invoke(app, ["demo", "--out", str(tmp_path / "d"), "--base", "gpt-17"])
    assert result.exit_code == 2 and "--base" in result.output and "smollm2-135m-instruct" in result.output
    assert not (tmp_path / "d").exists()  # refused before anything ran


def test_the_anchor_prompts_are_none_of_the_measured_ones():
    from flywheel.demo.general import ANCHOR_PROMPTS, ANCHOR_QUESTIONS, GENERAL_PROMPTS

    def norm(text: str) -> str:
        return " ".join(text.lower().replace("?", " ").replace(".", " ").split())

    measured = {norm(p) for p in GENERAL_PROMPTS} | {norm(q) for q, _ in SIMPLE_QUESTIONS}
    anchor = [norm(p) for p in ANCHOR_PROMPTS + ANCHOR_QUESTIONS]
    assert len(ANCHOR_PROMPTS) == 96 and len(ANCHOR_QUESTIONS) == 48 and len(set(anchor)) == len(anchor)
    assert not measured & set(anchor)


def test_the_self_anchor_is_the_bases_own_answers(tmp_path):
    import json

    from flywheel.demo import general
    from flywheel.models import TinySpec, build_tiny_model

    base = build_tiny_model(tmp_path / "m", TinySpec(hidden=32, layers=1, heads=2, ffn=64))
    prompts = [*general.ANCHOR_PROMPTS, *general.ANCHOR_QUESTIONS]
    replies = general._greedy_finished(base, prompts, general.ANCHOR_TOKENS)
    # a tiny random model rarely ends an answer: the rows are exactly its finished ones, in order
    rows = [json.loads(line) for line in general.self_anchor(base, tmp_path / "a" / "rows.jsonl").read_text().splitlines()]
    assert [(r["messages"][0]["content"], r["messages"][1]["content"]) for r in rows] == \
        [(p, text) for p, (text, finished) in zip(prompts, replies) if finished]
    assert all(len(text) > 0 for _, (text, finished) in zip(prompts, replies) if not finished)


def test_the_demo_refuses_distilled_anchors_on_a_base_that_trains_every_weight(tmp_path):
    from flywheel.cli.main import app

    for value, fragment in (("distill", "needs a LoRA base"), ("soft", "choose imitate or distill")):
        result = CliRunner().invoke(app, ["demo", "--out", str(tmp_path / "d"), "--anchor-loss", value],
                                    env={"COLUMNS": "200"})
        assert result.exit_code == 2 and "--anchor-loss" in result.output and fragment in result.output
    assert not (tmp_path / "d").exists()
