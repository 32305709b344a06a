"""A model served by `flywheel serve` as the judge, over HTTP (loop/judging.py HTTPJudge), and the
feedback route's rule on `source`.

The served model is an untrained tiny one, so its replies are never the JSON asked for: each
group is asked twice (the retry shows the reply and what was wrong with it), then skipped with
its reason, and no score is written. That is the path a weak judge takes in production; the
path of a well-formed reply is worked by hand in tests/unit/test_judge.py. The server records
its own traffic in the same store, as a `flywheel serve` with a trace store does: the judge's
questions come back as traces, and the judge leaves them alone. Verdict mode asks the server for one
token with its top 20 logprobs: what comes back is the served model's own distribution."""

from __future__ import annotations

import math
import time

import pytest

from flywheel.loop.curation_rules import CurationConfig
from flywheel.loop.judge import Attempt, group_attempts, verdict_messages
from flywheel.loop.judge_config import JudgeConfig
from flywheel.loop.judging import HTTPJudge, JudgeRequestError, SamplerJudge, run_judge
from flywheel.models import TinySpec, build_tiny_model
from flywheel.serve.builder import ServerConfig, build_server
from flywheel.traces import TraceStore


@pytest.fixture(scope="module")
def served(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("judge-http")
    model = build_tiny_model(root / "m", TinySpec(hidden=32, layers=2, heads=4, ffn=64, max_positions=4096))
    store = TraceStore(f"sqlite:///{root / 'traces.db'}")
    srv = build_server(ServerConfig(model=model, trace_store=store, name="tiny-judge")).start()
    try:
        yield srv, store, model
    finally:
        srv.close()
        store.close()


def _answers(srv, tag: str) -> list[str]:
    """Two answers to one question and one to another, the questions `tag`'s own."""
    import httpx

    q = [{"role": "user", "content": f"{tag}: capital of France?"}]
    records = [{"messages": q, "response": {"role": "assistant", "content": a}} for a in ("Paris", "Lyon")]
    r = httpx.post(f"{srv.url}/traces", json=records + [{"messages": [{"role": "user", "content": f"{tag}: hi"}],
                                                         "response": {"role": "assistant", "content": "Hello"}}])
    assert r.status_code == 200, r.text
    return [x["id"] for x in r.json()["results"]]


def test_a_client_cannot_send_judge_feedback(served):
    import httpx

    srv, store, _ = served
    trace_id = _answers(srv, "source")[0]
    r = httpx.post(f"{srv.url}/traces/{trace_id}/feedback", json={"score": 1.0, "source": "judge"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "source", r.text
    assert "only by flywheel's judge" in r.json()["error"]["message"]
    r = httpx.post(f"{srv.url}/traces/{trace_id}/feedback", json={"score": 1.0, "source": "user"})
    assert r.status_code == 200, r.text
    assert [f.source for f in store.get(trace_id).feedback] == ["user"]
    r = httpx.post(f"{srv.url}/traces/{trace_id}/feedback", json={"score": 1.0, "source": "robot"})
    assert r.status_code == 400 and "source" in r.json()["error"]["message"], r.text


def test_a_served_judge_that_never_answers_in_json_scores_nothing(served):
    srv, store, _ = served
    ids = _answers(srv, "judged")
    before = store.count()
    cfg = CurationConfig(judge={"max_tokens": 16})
    judge = HTTPJudge(srv.url, "tiny-judge")
    try:
        report = run_judge(store, judge, cfg)
    finally:
        judge.close()
    # the two answers to one question are one group, "hi" is scored alone against the rubric (an earlier
    # test's traces add groups of their own); every group was asked twice, none is scored
    assert report.groups >= 2 and report.groups_by_kind["prompt"] >= 1 and report.groups_by_kind["single"] >= 1
    assert report.retried_groups == report.groups and report.judged_groups == 0
    assert report.skipped == {"malformed twice": report.groups} and report.scores_written == 0
    assert all(r["reason"].startswith("malformed twice: ") for r in report.skipped_groups)
    assert all(f.source != "judge" for i in ids for f in store.get(i).feedback)

    deadline = time.monotonic() + 30  # the server stores its traces (the judge's questions) in the background
    while store.count() < before + 2 * report.groups and time.monotonic() < deadline:
        time.sleep(0.05)
    asked = [t for t in store.iter_traces() if (t.metadata.get("request_metadata") or {}).get("flywheel_judge")]
    assert len(asked) == 2 * report.groups
    assert asked[0].messages[0]["role"] == "system" and "Rubric:" in asked[0].messages[0]["content"]
    judge = HTTPJudge(srv.url, "tiny-judge")
    try:
        again = run_judge(store, judge, CurationConfig(judge={"max_tokens": 8}))
    finally:
        judge.close()
    assert again.left_alone["a judge's own question"] == len(asked)


def test_an_unreachable_judge_is_a_counted_skip(served):
    srv, store, _ = served
    _answers(srv, "unreachable")  # groups to judge of its own, whatever ran before
    judge = HTTPJudge("http://127.0.0.1:9/v1", "nobody", timeout_s=5)
    try:
        report = run_judge(store, judge, CurationConfig())
    finally:
        judge.close()
    assert report.groups >= 1 and report.judged_groups == 0
    assert report.skipped == {"request failed": report.groups}
    assert "ConnectError" in report.skipped_groups[0]["reason"]


def test_a_served_judge_in_verdict_mode_reads_the_models_top_logprobs(served):
    from flywheel.inference import LocalEngine

    srv, store, model = served
    engine = LocalEngine.from_path(str(model))
    q = [{"role": "user", "content": "verdict: 2+2?"}]
    groups, _ = group_attempts([Attempt(f"a{i}", q, [{"role": "assistant", "content": a}], seq=i)
                                for i, a in enumerate(("4", "5"))], JudgeConfig(mode="verdict"))
    questions = [verdict_messages(g, JudgeConfig(mode="verdict")) for g in groups]
    judge = HTTPJudge(srv.url, "tiny-judge")
    try:
        served_tops = judge.next_tokens(questions)
        _answers(srv, "verdict")
        report = run_judge(store, judge, CurationConfig(judge={"mode": "verdict"}))
    finally:
        judge.close()
    local_tops = SamplerJudge(engine, engine.tokenizer, "tiny")._next_tokens_sampled(questions)
    for got, want in zip(served_tops, local_tops):  # the same 20 tokens, the same logprobs
        assert [t for t, _ in got] == [t for t, _ in want]
        assert all(math.isclose(a, b, abs_tol=1e-4) for (_, a), (_, b) in zip(got, want))
    # a 259-token byte-level model spreads its mass thin: a y/n/Y/N among the top 20 gives a score, none skips
    assert report.mode == "verdict" and report.groups >= 3 and report.retried_groups == 0
    assert report.judged_groups + report.skipped.get("no verdict", 0) == report.groups, report.skipped


def test_a_server_without_logprobs_fails_verdict_questions_naming_the_option():
    import httpx

    def reply(request):
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content": "Yes"},
                                                      "logprobs": None}]})

    judge = HTTPJudge("http://judge.invalid/v1", "m")
    judge._http = httpx.Client(base_url="http://judge.invalid/v1", transport=httpx.MockTransport(reply))
    try:
        (got,) = judge.next_tokens([[{"role": "user", "content": "q"}]])
    finally:
        judge.close()
    assert isinstance(got, JudgeRequestError) and "top_logprobs: 20" in str(got)
