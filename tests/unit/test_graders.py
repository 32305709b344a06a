"""OpenAI's graders as flywheel runs them, on hand-worked cases."""

from __future__ import annotations

import math

import pytest

from flywheel.envs.graders import GraderError, bleu, build_grader, render, rouge_l, rouge_n, sample_of
from flywheel.sandbox import sandbox_available

ITEM = {"answer": "42", "meta": {"unit": "km"}, "tags": ["a", "b"]}


def grade(spec, text, item=ITEM, **kw):
    return build_grader(spec, **kw).grade(sample_of(text), item)


def test_templates_fill_dotted_paths_and_name_what_is_missing():
    s = sample_of('{"x": 1}')
    assert render("{{ item.answer }} {{item.meta.unit}} {{ item.tags.1 }}", s, ITEM) == "42 km b"
    assert render("{{ sample.output_json.x }}", s, ITEM) == "1"
    with pytest.raises(GraderError, match=r"\{\{ item.nope \}\} names nothing"):
        render("{{ item.nope }}", s, ITEM)


@pytest.mark.parametrize("op, text, expected", [
    ("eq", "42", 1.0), ("eq", "42 ", 0.0), ("ne", "41", 1.0), ("like", "it is 42.", 1.0),
    ("like", "forty-two", 0.0), ("ilike", "ANSWER 42", 1.0)])
def test_string_check(op, text, expected):
    spec = {"type": "string_check", "name": "s", "input": "{{ sample.output_text }}",
            "reference": "{{ item.answer }}", "operation": op}
    assert grade(spec, text) == expected


def test_similarity_metrics_worked_by_hand():
    assert rouge_n("a b c", "a b d", 1) == pytest.approx(2 / 3)  # 2 shared of 3 and 3
    assert rouge_n("a b c", "a b d", 2) == pytest.approx(0.5)  # {ab} of {ab, bc} and {ab, bd}
    assert rouge_l("a b c d", "a c d") == pytest.approx(2 * 0.75 * 1 / 1.75)  # LCS a c d: p 3/4, r 1
    # 1-gram 3/4; 2-, 3-, 4-gram add-one: 3/4, 2/3, 1/2; equal lengths: no brevity penalty
    expected = math.exp((math.log(3 / 4) + math.log(3 / 4) + math.log(2 / 3) + math.log(1 / 2)) / 4)
    assert bleu("a b c d", "a b c e") == pytest.approx(expected)  # 0.658
    assert bleu("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
    assert bleu("x y", "a b") == 0.0
    spec = {"type": "text_similarity", "name": "t", "input": "{{ sample.output_text }}",
            "reference": "kitten", "evaluation_metric": "fuzzy_match", "pass_threshold": 0.5}
    assert grade(spec, "sitting") == pytest.approx(2 * 4 / 13)  # difflib: 4 matched of 6 + 7
    assert build_grader(spec).run(sample_of("kitten"), {})["metadata"]["passed"] is True


def test_multi_combines_sub_graders_by_its_formula():
    spec = {"type": "multi", "name": "m", "calculate_output": "0.75 * exact + 0.25 * max(close, 0.5)",
            "graders": {"exact": {"type": "string_check", "name": "e", "input": "{{ sample.output_text }}",
                                  "reference": "{{ item.answer }}", "operation": "eq"},
                        "close": {"type": "text_similarity", "name": "c", "input": "{{ sample.output_text }}",
                                  "reference": "{{ item.answer }}", "evaluation_metric": "fuzzy_match"}}}
    assert grade(spec, "42") == pytest.approx(1.0)
    assert grade(spec, "41") == pytest.approx(0.25 * 0.5)  # fuzzy 0.5 vs the floor 0.5
    run = build_grader(spec).run(sample_of("42"), ITEM)
    assert run["sub_rewards"] == {"exact": 1.0, "close": 1.0} and run["reward"] == 1.0


def test_score_model_asks_a_model_and_clips_its_number():
    asked = []

    def model(name, messages):
        asked.append((name, messages))
        return "I'd say 7.5 out of 10"

    spec = {"type": "score_model", "name": "judge", "model": "tiny", "range": [0, 5],
            "input": [{"role": "user", "content": "Grade {{ sample.output_text }} against {{ item.answer }}"}]}
    assert grade(spec, "41", score_model=model) == 5.0
    assert asked == [("tiny", [{"role": "user", "content": "Grade 41 against 42"}])]


@pytest.mark.parametrize("spec, param", [
    ({"type": "regex"}, "grader.type"),
    ({"type": "string_check", "input": "x", "reference": "y", "operation": "gt"}, "grader.operation"),
    ({"type": "string_check", "input": "x", "operation": "eq"}, "grader.reference"),
    ({"type": "text_similarity", "input": "x", "reference": "y", "evaluation_metric": "cosine"},
     "grader.evaluation_metric"),
    ({"type": "python", "source": "def grade(s, i):\n  return (("}, "grader.source"),
    ({"type": "python", "source": "x = 1"}, "grader.source"),
    ({"type": "multi", "graders": {"a": {"type": "string_check", "input": "x", "reference": "x", "operation": "eq"}},
      "calculate_output": "__import__('os')"}, "calculate_output"),
    ({"type": "multi", "graders": {"a": {"type": "nope"}}, "calculate_output": "a"}, "grader.graders.a.type"),
    ({"type": "score_model", "model": "m", "input": []}, "grader.model"),
])
def test_invalid_graders_name_the_field(spec, param):
    with pytest.raises(GraderError) as info:
        build_grader(spec)
    assert info.value.param == param, str(info.value)


@pytest.mark.skipif(not sandbox_available(), reason="needs bubblewrap")
def test_python_graders_run_in_the_sandbox():
    spec = {"type": "python", "name": "p", "source": (
        "def grade(sample, item):\n"
        "    return 1.0 if sample['output_text'].strip() == item['answer'] else 0.25\n")}
    assert grade(spec, " 42\n") == 1.0 and grade(spec, "7") == 0.25
    escape = {"type": "python", "name": "p", "source": (
        "def grade(sample, item):\n    import urllib.request\n"
        "    urllib.request.urlopen('http://example.com', timeout=2)\n    return 1.0\n")}
    with pytest.raises(GraderError, match="the python grader failed"):
        grade(escape, "x")
