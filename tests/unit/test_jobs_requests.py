"""The fine-tuning job request, "auto" hyperparameters and the row checks per method."""

from __future__ import annotations

import io
import json

import pytest

from flywheel.jobs import JobRequest, RequestError
from flywheel.jobs.file_check import check_file
from flywheel.jobs.hyperparameters import auto_batch_size, auto_epochs, optimizer_steps, resolve


def body(**over):
    return {"model": "tiny", "training_file": "file-1", **over}


def test_a_bare_request_is_a_supervised_job_with_auto_hyperparameters():
    req = JobRequest.parse(body())
    assert (req.method_type, req.hyperparameters, req.grader) == ("supervised", {}, None)
    assert req.method() == {"type": "supervised", "supervised": {"hyperparameters": {}}}


def test_legacy_top_level_hyperparameters_become_the_supervised_method():
    req = JobRequest.parse(body(hyperparameters={"n_epochs": 2}))
    assert req.method_type == "supervised" and req.hyperparameters == {"n_epochs": 2}


def test_dpo_and_reinforcement_methods():
    req = JobRequest.parse(body(method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.2}}}))
    assert req.method_type == "dpo" and req.hyperparameters == {"beta": 0.2}
    grader = {"type": "string_check", "name": "g", "input": "{{ sample.output_text }}",
              "reference": "{{ item.answer }}", "operation": "eq"}
    req = JobRequest.parse(body(method={"type": "reinforcement", "reinforcement": {"grader": grader}}))
    assert req.grader == grader and req.method()["reinforcement"]["grader"] == grader


@pytest.mark.parametrize("request_body, param, words", [
    ({"training_file": "f"}, "model", "required"),
    (body(model=""), "model", "non-empty"),
    (body(epochs=3), "epochs", "unknown field"),
    (body(suffix="has space"), "suffix", "letters"),
    (body(suffix="x" * 65), "suffix", "at most 64"),
    (body(seed=-1), "seed", "integer"),
    (body(seed=True), "seed", "integer"),
    (body(method={"type": "ppo"}), "method.type", "one of"),
    (body(method={"type": "dpo", "supervised": {}}), "method.supervised", "does not belong"),
    (body(method={"type": "supervised", "supervised": {"hyperparameters": {"beta": 0.1}}}),
     "method.supervised.hyperparameters.beta", "unknown hyperparameter"),
    (body(method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 0}}}),
     "method.supervised.hyperparameters.n_epochs", "[1, 50]"),
    (body(method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2.5}}}),
     "method.supervised.hyperparameters.n_epochs", "integer"),
    (body(method={"type": "dpo", "dpo": {"hyperparameters": {"learning_rate_multiplier": "fast"}}}),
     "method.dpo.hyperparameters.learning_rate_multiplier", "'auto' or a number"),
    (body(method={"type": "reinforcement", "reinforcement": {}}), "method.reinforcement.grader", "grader"),
    (body(hyperparameters={"n_epochs": 1}, method={"type": "supervised"}), "hyperparameters", "not also"),
    (body(metadata={"k": 1}), "metadata.k", "strings"),
    (body(method={"type": "supervised", "supervised": {"hyperparameters": {"lora": {"rank": 0}}}}),
     "method.supervised.hyperparameters.lora.rank", "greater than or equal to 1"),
    (body(method={"type": "supervised", "supervised": {"hyperparameters": {"lora": {"targets": ["lm_head"]}}}}),
     "method.supervised.hyperparameters.lora.targets.0", "q_proj"),
    (body(method={"type": "reinforcement", "reinforcement": {"hyperparameters": {"lora": {"alpha": -1}}}}),
     "method.reinforcement.hyperparameters.lora.alpha", "greater than 0"),
    (body(integrations=[{"type": "wandb"}]), "integrations", "not supported"),
])
def test_invalid_requests_name_the_field(request_body, param, words):
    with pytest.raises(RequestError, match=None) as info:
        JobRequest.parse(request_body)
    assert info.value.param == param and words in str(info.value), (info.value.param, str(info.value))


def test_auto_rules_worked_by_hand():
    # batch: n // 32 within [1, 32]
    assert [auto_batch_size(n) for n in (10, 64, 1000, 5000)] == [1, 2, 31, 32]
    # epochs: ceil(3000 / n) within [1, 10]
    assert [auto_epochs(n) for n in (100, 301, 1000, 3000, 10_000)] == [10, 10, 3, 1, 1]
    lora = {"rank": 16, "alpha": 32.0, "dropout": 0.0,
            "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
    assert resolve("supervised", {"n_epochs": 2}, 1000) == {"n_epochs": 2, "batch_size": 31,
                                                            "learning_rate_multiplier": 1.0, "lora": lora}
    assert resolve("supervised", {"lora": "full"}, 10)["lora"] == "full"
    assert resolve("dpo", {}, 64)["beta"] == 0.1 and resolve("dpo", {}, 64)["lora"] == lora
    assert resolve("reinforcement", {}, 64)["lora"] == lora
    assert optimizer_steps(10, 4, 3) == 8  # 30 rows seen in batches of 4
    with pytest.raises(ValueError, match="at least one"):
        resolve("supervised", {}, 0)


def jsonl(*rows) -> io.BytesIO:
    return io.BytesIO("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows).encode() + b"\n")


def test_supervised_rows_report_every_bad_line_by_number():
    good = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    calls = {"messages": [{"role": "user", "content": "x"},
                          {"role": "assistant", "content": None,
                           "tool_calls": [{"id": "1", "type": "function",
                                           "function": {"name": "calc", "arguments": "{}"}}]},
                          {"role": "tool", "tool_call_id": "1", "content": "4"},
                          {"role": "assistant", "content": "4", "weight": 1}],
             "tools": [{"type": "function", "function": {"name": "calc", "parameters": {}}}]}
    report = check_file(jsonl(good, calls, "{oops", {"messages": [{"role": "user", "content": "hi"}]},
                              {"messages": [{"role": "robot", "content": "x"}]}, "", good), "supervised")
    assert (report.rows, report.bad_rows) == (3, 3) and not report.ok
    assert [n for n, _ in report.problems] == [3, 4, 5]
    assert "not valid JSON" in report.problems[0][1]
    assert "no assistant message" in report.problems[1][1]
    assert "messages[0].role" in report.problems[2][1]
    assert report.message("training file").startswith("training file has 3 invalid line(s) of 6: line 3:")


def test_dpo_and_reinforcement_rows():
    pair = {"input": {"messages": [{"role": "user", "content": "hi"}]},
            "preferred_output": [{"role": "assistant", "content": "hello"}],
            "non_preferred_output": [{"role": "assistant", "content": "go away"}]}
    bad = {**pair, "preferred_output": [{"role": "user", "content": "x"}]}
    report = check_file(jsonl(pair, bad, {"input": "hi"}), "dpo")
    assert report.rows == 1 and [n for n, _ in report.problems] == [2, 3]
    item = {"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"}
    answered = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    report = check_file(jsonl(item, answered), "reinforcement")
    assert report.rows == 1 and "end before the answer" in report.problems[0][1]
    assert check_file(io.BytesIO(b"\n\n"), "supervised").message("f") == "f has no rows"
