"""Curation rules on hand-made StoredTrace objects: outcome, prompt hash, RL / SFT / DPO items,
deduplication, decontamination, the held-out split, and the written files."""

from __future__ import annotations

import json
import random
from datetime import datetime, timedelta, timezone

import pytest
from pydantic import ValidationError

from flywheel.config import DPODataConfig, SFTDataConfig
from flywheel.loop.curation import curate, write_curated
from flywheel.loop.curation_rules import CurationConfig, choose_heldout, heldout_score, outcome, prompt_hash
from flywheel.traces.results import StoredFeedback, StoredTrace, StoredVerifier

T0 = datetime(2025, 1, 1, tzinfo=timezone.utc)
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]


def fb(minute: int = 0, **kw) -> StoredFeedback:
    return StoredFeedback(id=f"fb-{minute}-{sorted(kw)}", trace_id="t", created_at=T0 + timedelta(minutes=minute), **kw)


def trace(seq: int, prompt, response: str | None = "wrong", *, source: str = "serve", tools=None,
          feedback=(), **one_feedback) -> StoredTrace:
    """A trace of one user message (or the given messages); `one_feedback` makes one feedback."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    feedback = list(feedback) + ([fb(**one_feedback)] if one_feedback else [])
    return StoredTrace(id=f"t{seq}", seq=seq, idempotency_key=f"k{seq}", created_at=T0, source=source,
                       messages=messages, tools=tools, feedback=feedback,
                       response=None if response is None else {"role": "assistant", "content": response})


def verifier(prompt: str = "2+2=", answer: str = "4", **task) -> StoredVerifier:
    return StoredVerifier("arithmetic", {"id": f"task-{prompt}", "prompt": prompt, "answer": answer, **task})


ALL_TRAIN = CurationConfig(heldout_fraction=0.0, min_heldout=0)  # no held-out split: every item in train


def test_prompt_hash_ignores_case_whitespace_call_ids_and_argument_spelling():
    call = lambda cid, args: {"role": "assistant", "content": None, "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": "calc", "arguments": args}}]}
    a = [{"role": "system", "content": "Be  brief."}, {"role": "user", "content": "What is\n2+2?"},
         call("c1", '{"x": 1, "y": 2}'), {"role": "tool", "tool_call_id": "c1", "content": "4"}]
    b = [{"role": "developer", "content": " be brief. "}, {"role": "user", "content": [
        {"type": "text", "text": "WHAT IS "}, {"type": "text", "text": "2+2?"}]},
         call("zz", {"y": 2, "x": 1}), {"role": "tool", "tool_call_id": "zz", "content": "4"}]
    assert prompt_hash(a) == prompt_hash(b) and len(prompt_hash(a)) == 64
    assert prompt_hash(a[:2]) != prompt_hash(a)
    assert prompt_hash(a[:3]) != prompt_hash(a[:2] + [call("c1", '{"x": 1, "y": 3}')])
    assert prompt_hash([{"role": "user", "content": "2+2"}]) != prompt_hash([{"role": "user", "content": "2+3"}])
    assert prompt_hash([{"role": "user", "content": "hi"}]) != prompt_hash([{"role": "system", "content": "hi"}])
    assert prompt_hash("12+34=") == prompt_hash([{"role": "user", "content": " 12+34= "}])


def test_outcome_is_the_latest_feedback_with_a_verdict():
    cfg = CurationConfig()
    t = lambda *f: trace(1, "q", feedback=f)
    assert outcome(t(fb(0, score=0.0), fb(1, label="Thumbs_Up")), cfg) == "pass"
    assert outcome(t(fb(1, label="good"), fb(0, score=0.0)), cfg) == "pass"  # by created_at, not list order
    assert outcome(t(fb(0, label="good"), fb(1, score=0.2), fb(2, text="meh"), fb(3, label="unsure")), cfg) == "fail"
    assert outcome(t(fb(0, score=0.0), fb(0, score=1.0)), cfg) == "pass"  # same time: the later stored
    assert outcome(t(fb(0, score=0.7)), cfg) == "neutral"  # between fail_below and pass_at
    assert outcome(t(fb(0, score=0.9, label="good")), cfg) == "neutral"  # a score outranks the label
    assert outcome(t(fb(0, text="no verdict")), cfg) == "unknown"
    assert outcome(t(), cfg) == "unknown"


def test_config_is_strict_and_consistent():
    with pytest.raises(ValidationError, match="fail_below"):
        CurationConfig(fail_below=0.9, pass_at=0.5)
    with pytest.raises(ValidationError, match="both failure and success"):
        CurationConfig(success_labels=["Bad"])
    with pytest.raises(ValidationError, match="extra"):
        CurationConfig(heldout=0.1)


def test_failed_trace_with_a_verifier_becomes_an_rl_task():
    out = curate([trace(1, "2+2=", "5", score=0.0, verifier=verifier(metadata={"k": 1})),
                  trace(2, "3+3=", "6", score=1.0, verifier=verifier("3+3=", "6")),  # passed: nothing to learn
                  trace(3, "4+4=", "9", verifier=verifier("4+4=", "8")),  # no verdict: not a failure
                  trace(4, "5+5=", "1", label="wrong")],  # failed, no verifier
                 cfg=ALL_TRAIN)
    (item,) = out.rl.train
    # the task is the trace as served (one user message, no tools offered), graded by the verifier's answer
    assert item.row == {"env": "arithmetic", "trace_id": "t1", "source": "serve", "prompt_hash": prompt_hash("2+2="),
                        "verifier_prompt": "2+2=",
                        "task": {"id": "task-2+2=", "prompt": [{"role": "user", "content": "2+2="}], "answer": "4",
                                 "tools": [], "metadata": {"k": 1}, "split": "train"}}
    r = out.report
    assert (r.traces, r.failures, r.passes, r.failures_with_verifier) == (4, 2, 1, 1)


def test_bad_verifier_payloads_are_dropped_with_their_reason_and_the_rest_kept():
    bad = [StoredVerifier("arithmetic", {"id": "x", "prompt": 3, "answer": "4"}),
           StoredVerifier("arithmetic", {"prompt": "1+1=", "oops": 1}),
           StoredVerifier("arithmetic", ["not", "a", "dict"]),
           StoredVerifier("no_such_env", {"prompt": "1+1="}),
           StoredVerifier("arithmetic", {"prompt": [{"content": "no role"}]})]
    traces = [trace(i, f"q{i}", score=0.0, verifier=v) for i, v in enumerate(bad)]
    traces.append(trace(9, "2+2=", score=0.0, verifier=StoredVerifier("arithmetic", {"prompt": "2+2=", "answer": "4"})))
    out = curate(traces, cfg=ALL_TRAIN)
    assert [i.trace_id for i in out.rl.train] == ["t9"]
    assert out.rl.train[0].row["task"]["id"] == "t9"  # a task without an id takes the trace's
    assert out.report.dropped_count == 5
    assert [(d["trace_id"], d["kind"], d["reason"]) for d in out.report.dropped] == [
        ("t0", "rl", "verifier task: 'prompt' must be a non-empty string or list of messages, got number 3"),
        ("t1", "rl", "verifier task: unknown field 'oops' (Task fields: id, prompt, answer, tools, metadata, split)"),
        ("t2", "rl", "verifier task: must be a JSON object, got array"),
        ("t3", "rl", "verifier env 'no_such_env' is neither a built-in environment nor listed in curation.environments"),
        ("t4", "rl", "verifier task: prompt[0] must be a message object with a string 'role'")]


def test_a_verifier_names_only_environments_the_operator_trusts(tmp_path):
    """Feedback comes from clients, and replaying a verifier runs its environment's loader: an
    import path (or a file) names code to run, so only built-ins and curation.environments count."""
    task = {"prompt": "1+1=", "answer": "2"}
    names = ["os:abort", f"{tmp_path}/evil.py:load", "examples.custom_env:load"]
    traces = [trace(i, f"q{i}", score=0.0, verifier=StoredVerifier(n, task)) for i, n in enumerate(names)]
    out = curate(traces, cfg=ALL_TRAIN)
    assert out.rl.train == [] and [d["trace_id"] for d in out.report.dropped] == ["t0", "t1", "t2"]
    trusting = ALL_TRAIN.model_copy(update={"environments": ["examples.custom_env:load"]})
    assert [i.row["env"] for i in curate(traces, cfg=trusting).rl.train] == ["examples.custom_env:load"]


def test_a_correction_becomes_an_sft_row_with_the_trace_tools():
    prompt = [{"role": "developer", "content": "Use calc."}, {"role": "user", "content": "12*13?"}]
    fix = {"role": "assistant", "content": "156", "refusal": None}
    out = curate([trace(1, prompt, "144", tools=TOOLS, correction=fix),
                  trace(2, "q", correction={"role": "user", "content": "not a reply"})], cfg=ALL_TRAIN)
    (item,) = out.sft.train
    assert item.row == {"messages": [{"role": "system", "content": "Use calc."}, {"role": "user", "content": "12*13?"},
                                     {"role": "assistant", "content": "156"}], "tools": TOOLS}
    assert out.report.dropped == [{"trace_id": "t2", "kind": "sft",
                                   "reason": "correction: must be an assistant message, not 'user'"}]
    assert out.dpo.train == []  # a correction alone says nothing bad of the response: no pair without a failure


def test_good_and_bad_responses_to_one_prompt_make_dpo_pairs():
    traces = [trace(1, "Capital of France?", "Lyon", score=0.0),
              trace(2, "capital of  france?", "Paris", label="good"),
              trace(3, "Capital of France?", " lyon", score=0.1),  # the same bad response again
              trace(4, "Capital of France?", "Nice", score=0.0),
              trace(5, "Other question", "x", score=0.0)]  # a failure with nothing better: no pair
    out = curate(traces, cfg=ALL_TRAIN)
    rows = [i.row for i in out.dpo.train]
    assert rows == [{"input": {"messages": [{"role": "user", "content": "Capital of France?"}]},
                     "preferred_output": [{"role": "assistant", "content": "Paris"}],
                     "non_preferred_output": [{"role": "assistant", "content": bad}]} for bad in ("Lyon", "Nice")]
    assert out.report.duplicates["dpo"] == 1
    capped = curate(traces, cfg=CurationConfig(heldout_fraction=0, min_heldout=0, max_pairs_per_prompt=1))
    assert len(capped.dpo.train) == 1 and capped.report.dpo_over_cap == 1


def test_the_preferred_response_is_the_own_correction_then_the_first_correction_then_a_pass():
    own = lambda text: [fb(1, correction={"role": "assistant", "content": text})]
    traces = [trace(1, "Capital?", "Paris", score=1.0),
              trace(2, "Capital?", "Lyon", score=0.0, feedback=own("It is Paris.")),
              trace(3, "Capital?", "Rome", score=0.0),
              trace(4, "Capital?", "Nice", score=0.0, feedback=own("Paris, of course.")),
              trace(5, "Other?", "No", score=0.0), trace(6, "Other?", "Yes", label="thumbs_up")]
    pairs = [(i.row["preferred_output"][0]["content"], i.row["non_preferred_output"][0]["content"])
             for i in curate(traces, cfg=ALL_TRAIN).dpo.train]
    assert pairs == [("It is Paris.", "Lyon"), ("It is Paris.", "Rome"), ("Paris, of course.", "Nice"), ("Yes", "No")]


def test_duplicates_keep_the_first_trace_by_seq_and_are_counted():
    v = verifier()
    traces = [trace(3, "2+2=", score=0.0, verifier=v), trace(1, " 2+2= ", score=0.0, verifier=v),
              trace(2, "2+2=", score=0.0, verifier=v, correction={"role": "assistant", "content": "4"}),
              trace(4, "3+3=", score=0.0, verifier=verifier("3+3=", "6"))]
    out = curate(traces, cfg=ALL_TRAIN)
    assert [i.trace_id for i in out.rl.train] == ["t1", "t4"]
    assert [i.trace_id for i in out.sft.train] == ["t2"]
    assert [i.trace_id for i in out.dpo.train] == ["t1"]  # t2's correction against the response "wrong"
    assert out.report.duplicates == {"rl": 2, "sft": 0, "dpo": 2, "replay": 0}  # "wrong" again from t2 and t3


def test_decontamination_exact_and_ngram():
    long_eval = "Alice has three apples and Bob has five more apples than Alice has in her red basket"
    evals = ["What is 2+2?", [{"role": "system", "content": "x"}, {"role": "user", "content": long_eval}]]
    shared_13 = " ".join(long_eval.split()[1:14])
    shared_12 = " ".join(long_eval.split()[1:13])
    traces = [trace(1, "what is   2+2?", score=0.0, verifier=verifier()),  # exact
              trace(2, f"Solve: {shared_13}. Show work.", score=0.0, verifier=verifier("1+1=", "2")),  # 13-gram
              trace(3, f"Solve: {shared_12}. Show work.", score=0.0, verifier=verifier("1+2=", "3")),  # 12 only
              trace(4, "Be careful: what is 2+2? Think.", score=0.0, verifier=verifier("1+3=", "4")),  # short eval inside
              trace(5, "fresh question", score=0.0, verifier=verifier("What is 2+2?", "4"))]  # task prompt is an eval
    out = curate(traces, evals, ALL_TRAIN)
    assert [i.trace_id for i in out.rl.train] == ["t3"]
    r = out.report
    assert r.contaminated == {"rl": 4, "sft": 0, "dpo": 0, "replay": 0} and r.contaminated_by_reason == {"exact": 2, "ngram": 2}
    reasons = {c["trace_id"]: c["reason"] for c in r.contaminated_items}
    assert reasons["t1"] == reasons["t5"] == "exact: same prompt as eval prompt 0"
    assert reasons["t2"] == f"ngram: shares {shared_13.lower()!r} with eval prompt 1"
    assert reasons["t4"] == "ngram: shares 'what is 2 2' with eval prompt 0"
    assert r.eval_prompts == 2


def _many(n: int, sources=("a", "b")) -> list[StoredTrace]:
    return [trace(i, f"question {i}", score=0.0, source=sources[i % len(sources)],
                  verifier=verifier(f"{i}+1=", str(i + 1)), correction={"role": "assistant", "content": "ok"})
            for i in range(n)]


def test_heldout_split_is_deterministic_disjoint_and_per_source():
    traces = _many(40)
    out = curate(traces)
    shuffled = traces[:]
    random.Random(0).shuffle(shuffled)
    again = curate(shuffled)
    side = lambda c: {(i.kind, i.trace_id): s for k in ("rl", "sft") for s in ("train", "heldout")
                      for i in getattr(getattr(c, k), s)}
    assert side(out) == side(again)
    held = {i.prompt_hash for i in out.rl.heldout + out.sft.heldout}
    trained = {i.prompt_hash for i in out.rl.train + out.sft.train}
    assert held and trained and not held & trained
    assert {i.prompt_hash for i in out.rl.heldout} == {i.prompt_hash for i in out.sft.heldout}  # kinds agree
    assert 4 <= len(out.rl.heldout) <= 16  # ~25 % of 40
    assert out.report.items["rl"] == {"train": len(out.rl.train), "heldout": len(out.rl.heldout)}
    # a later cycle with more traces keeps every old prompt on its side
    bigger = curate(_many(80))
    assert {(k, t): s for (k, t), s in side(bigger).items() if int(t[1:]) < 40} == side(out)
    other_seed = curate(traces, cfg=CurationConfig(seed="other"))
    assert {i.trace_id for i in other_seed.rl.heldout} != {i.trace_id for i in out.rl.heldout}


def test_every_source_with_two_prompts_holds_at_least_min_heldout():
    cfg = CurationConfig(heldout_fraction=0.0, min_heldout=1)
    out = curate(_many(6, sources=("a", "b", "c")) + [trace(99, "lonely", score=0.0, source="d",
                                                               verifier=verifier())], cfg=cfg)
    assert out.report.sources == {s: {"train": 1, "heldout": 1} for s in "abc"} | {"d": {"train": 1, "heldout": 0}}
    hashes = [prompt_hash(f"q{i}") for i in range(5)]
    held = choose_heldout({"s": hashes}, CurationConfig(heldout_fraction=0.0, min_heldout=9))
    assert len(held) == 4  # the top-up leaves the source one training prompt
    lowest = min(hashes, key=lambda h: heldout_score("flywheel", h))
    assert choose_heldout({"s": hashes}, cfg) == {lowest}


def test_a_prompt_seen_in_two_sources_belongs_to_the_source_of_its_first_trace():
    cfg = CurationConfig(heldout_fraction=0.0, min_heldout=0)
    fix = {"role": "assistant", "content": "4"}
    out = curate([trace(2, "2+2=", source="b", correction=fix), trace(1, "2+2=", source="a", score=0.0,
                                                                      verifier=verifier())], cfg=cfg)
    assert out.report.sources == {"a": {"train": 1, "heldout": 0}}
    assert [(i.kind, i.source) for i in out.rl.train + out.sft.train] == [("rl", "a"), ("sft", "b")]


def test_write_curated_is_deterministic_and_loads_with_the_sft_and_dpo_loaders(tmp_path):
    from flywheel.models.tiny import build_tokenizer
    from flywheel.train.dpo_data import load_pairs
    from flywheel.train.sft_data import load_sft_examples

    traces = [trace(1, "2+2=", "5", score=0.0, verifier=verifier(), tools=TOOLS,
                    correction={"role": "assistant", "content": "4"}),
              trace(2, [{"role": "user", "content": "12*13?"}, {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "c", "type": "function", "function": {"name": "calc", "arguments": '{"e": "12*13"}'}}]},
                        {"role": "tool", "tool_call_id": "c", "content": "156"}], "155", label="bad", tools=TOOLS,
                    correction={"role": "assistant", "content": "156"})]
    a = write_curated(curate(traces, cfg=ALL_TRAIN), tmp_path / "a")
    b = write_curated(curate(traces[::-1], cfg=ALL_TRAIN), tmp_path / "b")
    assert sorted(a) == sorted([f"{k}_{s}" for k in ("rl", "sft", "dpo", "replay") for s in ("train", "heldout")] + ["report"])
    assert all(a[k].read_bytes() == b[k].read_bytes() for k in a)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(p.name for p in a.values())  # no temp files
    report = json.loads(a["report"].read_text())
    assert report["items"]["sft"] == {"train": 2, "heldout": 0} and report["items"]["dpo"]["train"] == 2
    assert a["sft_heldout"].read_text() == ""
    rl_line = a["rl_train"].read_text().splitlines()[0]
    assert list(json.loads(rl_line)) == sorted(json.loads(rl_line))  # keys sorted

    tok = build_tokenizer()
    examples, data_report = load_sft_examples([str(a["sft_train"])], tok, SFTDataConfig(train=["x"]),
                                              log=pytest.fail)
    assert data_report.examples == 2 and all(any(e.loss_mask) for e in examples)
    pairs, skipped = load_pairs([str(a["dpo_train"])], tok, DPODataConfig(train=["x"]), log=pytest.fail)
    assert len(pairs) == 2 and skipped == 0
    assert tok.decode([i for i, m in zip(pairs[0].chosen_ids, pairs[0].chosen_mask) if m]).startswith("4")


def completion(seq: int, prompt: str, response: str, **one_feedback) -> StoredTrace:
    """A /v1/completions trace: the prompt text as served, no messages."""
    t = trace(seq, prompt, response, **one_feedback)
    return StoredTrace(**{**t.__dict__, "messages": [], "prompt": prompt})


def test_the_rl_task_is_the_trace_as_served_graded_by_its_verifier():
    """The gate and RL replay what production saw (system message, tools offered), not the
    verifier's own prompt; decontamination still reads both."""
    served = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 2+2?"}]
    out = curate([trace(1, served, "5", score=0.0, tools=TOOLS, verifier=verifier("2+2=", "4"))], cfg=ALL_TRAIN)
    (item,) = out.rl.train
    assert item.row["task"]["prompt"] == served and item.row["task"]["tools"] == TOOLS
    assert item.row["task"]["answer"] == "4" and item.row["verifier_prompt"] == "2+2="
    no_prompt = StoredVerifier("arithmetic", {"answer": "4"})  # a client may leave the prompt out
    (item,) = curate([trace(1, served, "5", score=0.0, verifier=no_prompt)], cfg=ALL_TRAIN).rl.train
    assert item.row["task"]["prompt"] == served and item.row["task"]["tools"] == [] and "verifier_prompt" not in item.row
    episode = served + [{"role": "assistant", "content": "<tool_call>...</tool_call>"}, {"role": "tool", "content": "5"}]
    (item,) = curate([trace(1, episode, "5", score=0.0, verifier=verifier())], cfg=ALL_TRAIN).rl.train
    assert item.row["task"]["prompt"] == served  # the agent's turns are played again, not given
    follow_up = episode + [{"role": "user", "content": "And 3+3?"}]
    (item,) = curate([trace(1, follow_up, "5", score=0.0, verifier=verifier("3+3=", "6"))], cfg=ALL_TRAIN).rl.train
    assert item.row["task"]["prompt"] == follow_up  # the question graded is the last one asked
    dirty = curate([trace(1, served, "5", score=0.0, verifier=verifier("2+2=", "4"))], ["2+2="], cfg=ALL_TRAIN)
    assert dirty.rl.train == [] and dirty.report.contaminated["rl"] == 1


def test_completion_traces_stay_completions_end_to_end(tmp_path):
    """A /v1/completions trace makes raw-text rows: RL tasks with a string prompt, SFT and
    replay rows as prompt/completion (loaded without the chat template), no DPO pair."""
    from flywheel.models.tiny import build_tokenizer
    from flywheel.train.sft_data import load_sft_examples

    out = curate([completion(1, "12+34=", "47", score=0.0, verifier=verifier("12+34=", "46")),
                  completion(2, "20+20=", "41", score=0.0, correction={"role": "assistant", "content": "40"}),
                  completion(3, "20+20=", "40", score=1.0),
                  trace(4, "30+30=", "60", score=1.0)], cfg=ALL_TRAIN)
    (rl,) = out.rl.train
    assert rl.row["task"]["prompt"] == "12+34=" and rl.row["task"]["tools"] is None
    assert [i.row for i in out.sft.train] == [{"prompt": "20+20=", "completion": "40"}]
    assert [i.row for i in out.replay.train] == [{"prompt": "20+20=", "completion": "40"},
                                                 {"messages": [{"role": "user", "content": "30+30="},
                                                               {"role": "assistant", "content": "60"}]}]
    assert out.dpo.train == [] and {d["kind"] for d in out.report.dropped} == {"dpo"}
    assert out.report.formats == {"chat": 1, "completion": 3}
    files = write_curated(out, tmp_path)
    tok = build_tokenizer()
    (ex,), _ = load_sft_examples([str(files["sft_train"])], tok, SFTDataConfig(train=["x"], format="auto"),
                                 log=pytest.fail)
    assert ex.ids == tok.encode("20+20=") + tok.encode("40") + [tok.eos_token_id]  # raw text, no template


def test_passing_traces_become_replay_rows():
    out = curate([trace(1, "2+2=", "4", score=1.0), trace(2, "3+3=", "7", score=0.0), trace(3, "5+5=", "10")],
                 cfg=ALL_TRAIN)
    assert [i.row for i in out.replay.train] == [{"messages": [{"role": "user", "content": "2+2="},
                                                                {"role": "assistant", "content": "4"}]}]
    assert out.report.items["replay"] == {"train": 1, "heldout": 0}


def test_turns_of_one_episode_land_on_one_side_of_the_split():
    """Turn 1 (question -> call) corrected, turn 2 (question, call, result -> answer) failed with a
    verifier: the SFT row and the RL task share the question, so they must share a side."""
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "1+1"}'}}]}
    fixed = {"role": "assistant", "content": "ok"}
    traces = []
    for q in range(60):
        question = [{"role": "user", "content": f"What is {q} + {q}?"}]
        traces.append(trace(2 * q + 1, question, None, correction=fixed))
        traces.append(trace(2 * q + 2, question + [call, {"role": "tool", "tool_call_id": "c", "content": "2"}],
                            "It is 3.", score=0.0, verifier=verifier(f"{q}+{q}=", str(2 * q))))
    out = curate(traces, cfg=CurationConfig(heldout_fraction=0.3))
    side = {}
    for kind in ("rl", "sft"):
        for name in ("train", "heldout"):
            for item in getattr(getattr(out, kind), name):
                side.setdefault(item.root_hash, set()).add(name)
    assert len(side) == 60 and all(len(s) == 1 for s in side.values())
    assert 5 < len(out.rl.heldout) == len(out.sft.heldout) < 40


def test_replay_rows_per_sft_stage_follow_ratio_then_minimum_then_what_is_there():
    from flywheel.loop.cycle import replay_count

    assert replay_count(100, available=1000, ratio=2.0) == 200  # 2 per correction
    assert replay_count(13, available=1000, ratio=2.0, minimum=256) == 256  # 26 would be outweighed
    assert replay_count(200, available=1000, ratio=2.0, minimum=256) == 400  # the ratio already exceeds it
    assert replay_count(13, available=40, ratio=2.0, minimum=256) == 40  # no more than was curated
    assert replay_count(7, available=50, ratio=0.5) == 3  # rounded down


def test_an_sft_stage_mixes_corrections_replay_and_anchor_rows(tmp_path):
    from types import SimpleNamespace

    from flywheel.loop.cycle import CycleError, _sft_mix, read_anchor_rows

    def jsonl(name: str, n: int) -> str:
        path = tmp_path / name
        path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{name} {i}"}]}) + "\n"
                                for i in range(n)) + "\n", encoding="utf-8")
        return str(path)

    files = {"sft_train": jsonl("sft", 3), "replay_train": jsonl("replay", 50)}
    mix = SimpleNamespace(replay_ratio=2.0, min_replay=10, anchor_rows=5, anchor_loss="imitate")
    anchor = read_anchor_rows([jsonl("a1", 4), jsonl("a2", 4)])
    path, parts = _sft_mix(files, 3, mix, anchor, tmp_path / "mix.jsonl", "c1")
    assert parts == {"sft": 3, "replay": 10, "anchor": 5}
    kinds = [json.loads(line)["messages"][0]["content"].split()[0] for line in open(path, encoding="utf-8")]
    assert sorted(set(kinds)) == ["a1", "a2", "replay", "sft"] and len(kinds) == 18
    again, _ = _sft_mix(files, 3, mix, anchor, tmp_path / "again.jsonl", "c1")
    assert open(again).read() == open(path).read()  # seeded by the cycle: a resumed cycle mixes the same rows
    assert not any("distill" in json.loads(line) for line in open(path, encoding="utf-8"))
    distilled, _ = _sft_mix(files, 3, SimpleNamespace(**{**vars(mix), "anchor_loss": "distill"}), anchor,
                            tmp_path / "distilled.jsonl", "c1")
    marked = {json.loads(line)["messages"][0]["content"].split()[0]: json.loads(line).get("distill")
              for line in open(distilled, encoding="utf-8")}
    assert marked == {"a1": True, "a2": True, "replay": None, "sft": None}  # the anchor rows alone
    for bad in ("[1, 2]", '{"prompt": "x"}', "{not json"):
        (tmp_path / "bad.jsonl").write_text('{"messages": []}\n\n' + bad + "\n", encoding="utf-8")
        with pytest.raises(CycleError, match=r"bad.jsonl:3 is not an SFT row"):
            read_anchor_rows([str(tmp_path / "bad.jsonl")])
    raw = tmp_path / "raw.jsonl"  # prompt/completion anchor rows, as README allows SFT data to be
    raw.write_text('{"prompt": "12+34=", "completion": "46"}\n', encoding="utf-8")
    assert read_anchor_rows([str(raw)]) == ['{"prompt": "12+34=", "completion": "46"}']
    with pytest.raises(CycleError, match=r"cannot read '.*missing.jsonl'"):
        read_anchor_rows([str(tmp_path / "missing.jsonl")])
    from flywheel.config import validate
    from flywheel.loop.cycle import LoopStores
    from flywheel.loop.loop_config import LoopConfig

    cfg = validate({"data_dir": str(tmp_path / "loop"), "train": {"anchor_data": [str(tmp_path / "bad.jsonl")]}},
                   LoopConfig)
    with pytest.raises(CycleError, match=r"bad.jsonl:3"):  # up front, not in every cycle
        LoopStores(cfg)
