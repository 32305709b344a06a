"""The judge of traces without a verifier (loop/judge.py, loop/judging.py), worked by hand: which
traces it takes, how they group, what it is asked, how strictly its reply is read, the feedback
its scores become, and that curation turns judged-bad and judged-good answers into a DPO pair.
The judge here is a scripted JudgeClient (the protocol judging.py defines); a served model as
judge over HTTP is tests/service/test_judge_http.py."""

from __future__ import annotations

import json
import math
from datetime import datetime, timedelta, timezone

import pytest
from alembic import command
from sqlalchemy import text

from flywheel.config import ConfigError, validate
from flywheel.database import open_engine, writing
from flywheel.loop.curation import curate
from flywheel.loop.curation_rules import CurationConfig, outcome, verdict
from flywheel.loop.judge import (
    Attempt,
    JudgeAnswerError,
    attempt_of,
    clip,
    feedback_bodies,
    group_attempts,
    judge_messages,
    parse_answer,
    verdict_messages,
    verdict_score,
    verdict_side,
)
from flywheel.loop.judge_config import JudgeConfig
from flywheel.loop.judging import JudgeRequestError, SamplerJudge, judge_groups, run_judge
from flywheel.traces import TraceStore
from flywheel.traces.results import StoredFeedback, StoredTrace, StoredVerifier
from flywheel.traces.tables import SCHEMA as TRACES

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def said(text: str) -> dict:
    return {"role": "assistant", "content": text}


def attempt(i: str, prompt, answer: str = "x", tenant: str = "default", seq: int = 0) -> Attempt:
    return Attempt(i, prompt, [said(answer)], tenant, seq)


class Scripted:
    """A judge that replies from a script, in order, and records what it was asked."""

    model = "scripted-judge"

    def __init__(self, *replies):
        self.replies, self.asked = list(replies), []

    def chat(self, conversations, max_tokens):
        self.asked += list(conversations)
        return [self.replies.pop(0) for _ in conversations]


# ---------------------------------------------------------------- grouping


def test_same_prompt_groups_first_then_same_opening_then_singletons():
    q = [user("What is 2+2?")]
    a1, a2 = attempt("a1", q, seq=1), attempt("a2", [user("  what is 2+2? ")], seq=2)  # same once normalised
    # b1 and b2 share an opening but not a prompt: their later turns differ
    b1 = attempt("b1", [user("Plan a trip"), said("Where to?"), user("Rome")], seq=3)
    b2 = attempt("b2", [user("Plan a trip"), said("Where to?"), user("Paris")], seq=4)
    c = attempt("c", [user("Alone")], seq=5)
    other = attempt("z", q, tenant="acme", seq=6)  # same prompt, another tenant: never grouped with a1
    groups, alone = group_attempts([c, b2, a2, other, b1, a1], JudgeConfig())
    assert [(g.kind, [m.id for m in g.members]) for g in groups] == [
        ("prompt", ["a1", "a2"]), ("opening", ["b1", "b2"]), ("single", ["c"]), ("single", ["z"])]
    assert alone == []
    assert groups[1].context == [user("Plan a trip")]  # the opening, shown once
    assert groups[1].answers[0] == (said("Where to?"), user("Rome"), said("x"))
    assert groups[0].context == q and groups[0].answers == ((said("x"),), (said("x"),))
    _, alone = group_attempts([c], JudgeConfig(singletons="skip"))
    assert alone == [c]


def test_a_large_group_splits_evenly_and_rubric_mode_scores_each_alone():
    many = [attempt(f"t{i}", [user("q")], seq=i) for i in range(9)]
    groups, _ = group_attempts(many, JudgeConfig(max_group=8))
    assert [len(g.members) for g in groups] == [5, 4]
    assert len({g.id for g in groups}) == 2
    groups, _ = group_attempts(many[:3], JudgeConfig(mode="rubric"))
    assert [(g.kind, len(g.members)) for g in groups] == [("single", 1)] * 3


def _trace(feedback=(), response=said("4"), messages=(user("2+2?"),)) -> StoredTrace:
    return StoredTrace(id="t", seq=1, idempotency_key="t", created_at=T0, source="serve", messages=list(messages),
                       response=response, feedback=list(feedback))


def _fb(minute: int = 0, **kw) -> StoredFeedback:
    return StoredFeedback(id=f"f{minute}", trace_id="t", created_at=T0 + timedelta(minutes=minute), **kw)


def test_only_traces_without_a_verifier_or_user_verdict_are_judged():
    cfg = CurationConfig()
    assert isinstance(attempt_of(_trace(), cfg), Attempt)
    assert isinstance(attempt_of(_trace([_fb(text="a comment")]), cfg), Attempt)  # text judges nothing
    assert attempt_of(_trace(response=None), cfg) == "no response"
    assert attempt_of(_trace([_fb(verifier=StoredVerifier("calculator", {}))]), cfg) == "a verifier grades it"
    assert attempt_of(_trace([_fb(label="good")]), cfg) == "a user's verdict"
    assert attempt_of(_trace([_fb(score=0.3, source="judge")]), cfg) == "judged already"
    rejudge = CurationConfig(judge={"rejudge": True})
    assert isinstance(attempt_of(_trace([_fb(score=0.3, source="judge")]), rejudge), Attempt)


# ---------------------------------------------------------------- the question and the answer


def test_the_question_shows_the_task_once_and_each_answer_numbered():
    calls = {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]}
    groups, _ = group_attempts([Attempt("a", [user("2+2?")], [said("4")], seq=1),
                                Attempt("b", [user("2+2?")], [calls], seq=2)], JudgeConfig(rubric="Be right."))
    system, question = judge_messages(groups[0], JudgeConfig(rubric="Be right."))
    assert system["role"] == "system" and "Rubric: Be right." in system["content"]
    assert '{"scores": {"1": <score>, "2": <score>}, "explanation": "<one short sentence>"}' in system["content"]
    assert question["content"] == ("# Task\n[user] 2+2?\n\n# Answer 1\n[assistant] 4\n\n"
                                   '# Answer 2\n[assistant calls add] {"a": 2}\n\n'
                                   "Scores for answers 1 to 2, as the JSON object:")
    assert clip("abcdefghij", 6) == "abcd\n...[4 characters cut]...\nij"


def test_the_reply_is_read_strictly():
    assert parse_answer('{"scores": {"1": 0.9, "2": 0}, "explanation": "1 is right"}', 2).scores == (0.9, 0.0)
    assert parse_answer('```json\n{"scores": {"1": 1}}\n```', 1).scores == (1.0,)
    bad = {
        'Sure! {"scores": {"1": 1}}': "not a JSON object",
        '[0.5]': "expected a JSON object, got list",
        '{"scores": {"1": 0.5}}': "missing for answer(s) 2",
        '{"scores": {"1": 0.5, "2": 0.1, "3": 1}}': "for unknown answer id(s) '3'",
        '{"scores": {"1": 1.5, "2": 0}}': "scores.1: 1.5 is outside [0, 1]",
        '{"scores": {"1": true, "2": 0}}': "scores.1: expected a number",
        '{"scores": {"1": NaN, "2": 0}}': "scores.1: expected a number",
        '{"scores": {"1": 1, "1": 0, "2": 0}}': "key '1' appears twice",
        '{"scores": {"1": 1, "2": 0}, "winner": 1}': "unknown key(s) 'winner'",
        '{"scores": [1, 0]}': "'scores' must be an object",
        '{"scores": {"1": 1, "2": 0}, "explanation": 3}': "'explanation' must be a string",
    }
    for reply, why in bad.items():
        with pytest.raises(JudgeAnswerError, match=None) as e:
            parse_answer(reply, 2)
        assert why in str(e.value), (reply, str(e.value))


def test_a_malformed_reply_is_asked_again_once_then_the_group_is_skipped():
    groups, _ = group_attempts([attempt("a", [user("q")], seq=1), attempt("b", [user("q")], seq=2),
                                attempt("c", [user("r")], seq=3), attempt("d", [user("r")], seq=4),
                                attempt("e", [user("s")], seq=5), attempt("f", [user("s")], seq=6)], JudgeConfig())
    judge = Scripted("no idea", '{"scores": {"1": 0}}', JudgeRequestError("HTTP 500"),  # first round
                     '{"scores": {"1": 0.2, "2": 0.8}}', "still prose")  # the two retries
    results = judge_groups(judge, groups, JudgeConfig())
    assert [(r.asked, r.answer and r.answer.scores, r.reason) for r in results] == [
        (2, (0.2, 0.8), None),
        (2, None, "malformed twice: not a JSON object (Expecting value: line 1 column 1 (char 0)): 'still prose'"),
        (1, None, "request failed: HTTP 500")]
    retry = judge.asked[3]
    assert retry[:2] == judge.asked[0] and retry[2] == said("no idea")
    assert retry[3]["content"].startswith("That reply could not be read: not a JSON object")


# ---------------------------------------------------------------- scores -> feedback -> curation


def test_scores_become_judge_feedback_with_the_model_and_group():
    groups, _ = group_attempts([attempt("a", [user("q")], seq=1), attempt("b", [user("q")], seq=2)], JudgeConfig())
    answer = parse_answer('{"scores": {"1": 0.9, "2": 0.1}, "explanation": "b is wrong"}', 2)
    (ia, fa), (ib, fb) = feedback_bodies(groups[0], answer, "judge-m", JudgeConfig())
    assert (ia, fa["score"], fa["source"], ib, fb["score"]) == ("a", 0.9, "judge", "b", 0.1)
    assert json.loads(fa["text"]) == {"judge": "judge-m", "mode": "ranking", "group": groups[0].id,
                                      "kind": "prompt", "size": 2, "explanation": "b is wrong"}
    assert fa["idempotency_key"].startswith("judge:") and fa["idempotency_key"].endswith(f":{groups[0].id}:a")


def test_a_judge_score_is_read_with_the_judges_thresholds():
    cfg = CurationConfig()  # user: fail < 0.5, pass >= 1.0; judge: fail < 0.5, pass >= 0.7
    assert verdict(_fb(score=0.8), cfg) == "neutral"
    assert verdict(_fb(score=0.8, source="judge"), cfg) == "pass"
    assert verdict(_fb(score=0.6, source="judge"), cfg) == "neutral"
    assert verdict(_fb(score=0.4, source="judge"), cfg) == "fail"
    assert verdict(_fb(score=0.8, source="judge"), CurationConfig(judge={"pass_at": 0.9})) == "neutral"
    with pytest.raises(ConfigError, match="judge.fail_below"):
        validate({"judge": {"fail_below": 0.8, "pass_at": 0.6}}, CurationConfig)


def test_judged_traces_in_a_store_become_a_dpo_pair_and_no_rl_task(tmp_path):
    store = TraceStore(f"sqlite:///{tmp_path / 'traces.db'}")
    q = [user("Capital of France?")]
    store.add_traces([{"id": "good", "messages": q, "response": said("Paris")},
                      {"id": "bad", "messages": q, "response": said("Lyon")},
                      {"id": "user-judged", "messages": q, "response": said("Nice")},
                      {"id": "theirs", "messages": q, "response": said("Paris!")}])
    store.add_traces([{"id": "acme", "messages": q, "response": said("Paris")}], tenant="acme")
    store.add_feedback("user-judged", {"label": "bad"})
    judge = Scripted('{"scores": {"1": 1, "2": 0.1, "3": 0.5}, "explanation": "Lyon is wrong"}',
                     '{"scores": {"1": 0.95}}')  # acme's trace, alone: scored against the rubric
    report = run_judge(store, judge, CurationConfig())
    assert report.left_alone == {"a user's verdict": 1}
    assert (report.groups, report.judged_groups, report.scores_written) == (2, 2, 4)
    assert report.verdicts == {"pass": 2, "fail": 1, "neutral": 1} and report.skipped == {}
    assert "Paris!" in judge.asked[0][1]["content"] and "Nice" not in judge.asked[0][1]["content"]
    assert [(f.score, f.source) for f in store.get("bad").feedback] == [(0.1, "judge")]
    assert store.get("acme", tenant="acme").feedback[0].source == "judge"
    again = run_judge(store, Scripted(), CurationConfig())  # nothing left to judge
    assert again.groups == 0 and again.left_alone["judged already"] == 4

    traces = list(store.iter_traces())
    assert [outcome(t, CurationConfig()) for t in traces] == ["pass", "fail", "fail", "neutral", "pass"]
    curated = curate(traces, cfg=CurationConfig(heldout_fraction=0.0))
    pairs = [(i.row["preferred_output"][0]["content"], i.row["non_preferred_output"][0]["content"])
             for i in curated.dpo.train + curated.dpo.heldout]
    assert ("Paris", "Lyon") in pairs and ("Paris", "Nice") in pairs
    assert curated.rl.train == curated.rl.heldout == []  # no verifier: no RL task, nothing for the gate
    store.close()


def test_a_store_before_feedback_sources_is_upgraded_with_its_feedback_as_user(db_url):
    engine = open_engine(db_url)
    with writing(engine) as conn:
        command.upgrade(TRACES.config(conn), "0002")
        conn.execute(text("INSERT INTO traces (id, idempotency_key, content_hash, created_at, source, messages, tenant) "
                          "VALUES ('t-old', 't-old', 'h', '2026-11-01 00:00:00', 'serve', '[]', 'default')"))
        conn.execute(text("INSERT INTO trace_feedback (id, trace_id, content_hash, created_at, score, tenant) "
                          "VALUES ('f-old', 't-old', 'h', '2026-11-01 00:01:00', 0.0, 'default')"))
    engine.dispose()
    with TraceStore(db_url) as store:
        assert store.stats().schema_revision == TRACES.head() == "0003"
        assert [(f.id, f.source) for f in store.get("t-old").feedback] == [("f-old", "user")]


def test_the_cli_reports_every_skip_and_fails_when_no_group_was_judged(tmp_path):
    from typer.testing import CliRunner

    from flywheel.cli.main import app

    db = f"sqlite:///{tmp_path / 'traces.db'}"
    with TraceStore(db) as store:
        store.add_traces([{"messages": [user("q")], "response": said(a)} for a in ("a", "b")])
    r = CliRunner().invoke(app, ["traces", "judge", "--judge-url", "http://127.0.0.1:9/v1", "--judge-model", "m",
                                 "--db", db, "--mode", "rubric"])
    assert r.exit_code == 1, r.output
    report = json.loads(r.stdout[r.stdout.index("{"):])
    assert (report["mode"], report["groups"], report["skipped"]) == ("rubric", 2, {"request failed": 2})
    bad = CliRunner().invoke(app, ["traces", "judge", "--judge-url", "u", "--judge-model", "m", "--db", db,
                                   "--mode", "vote"])
    assert bad.exit_code == 2 and "judge.mode" in bad.output


# ---------------------------------------------------------------- verdict mode


def test_verdict_tokens_and_score_worked_by_hand():
    assert [verdict_side(t) for t in (" yes", "Yes", "YES", "y", " Ye", "No", " no", "n", "N",
                                      "not", "You", " ", "", "maybe")] == [
        "yes", "yes", "yes", "yes", "yes", "no", "no", "no", "no", None, None, None, None, None]
    # P(" yes") 0.5 + P("Yes") 0.1 = 0.6 against P("No") 0.2; "maybe" and "The" count for neither
    got = verdict_score([(" yes", math.log(0.5)), ("Yes", math.log(0.1)), ("No", math.log(0.2)),
                         ("maybe", math.log(0.1)), ("The", math.log(0.05))])
    assert got is not None
    assert (round(got.score, 12), round(got.p_yes, 12), round(got.p_no, 12)) == (0.75, 0.6, 0.2)
    assert got.answer().scores == (got.score,) and got.answer().explanation == "P(yes)=0.6000 P(no)=0.2000"
    assert verdict_score([("no", math.log(0.3)), (" n", math.log(0.1))]).score == 0.0
    assert verdict_score([("Yes", 0.0)]).score == 1.0
    assert verdict_score([("The", math.log(0.9))]) is None  # neither: no score is made up
    assert verdict_score([("Yes", -math.inf), ("No", -math.inf)]) is None
    assert verdict_score([]) is None


def test_the_verdict_question_shows_one_answer_and_asks_yes_or_no():
    groups, alone = group_attempts([Attempt("a", [user("2+2?")], [said("4")], seq=1),
                                    Attempt("b", [user("2+2?")], [said("5")], seq=2)], JudgeConfig(mode="verdict"))
    assert alone == [] and [(g.kind, [m.id for m in g.members]) for g in groups] == [("single", ["a"]),
                                                                                   ("single", ["b"])]
    system, question = verdict_messages(groups[1], JudgeConfig(mode="verdict", rubric="Be right."))
    assert system["content"] == ("You judge the answers of an AI assistant.\nRubric: Be right.\n"
                                 "You are shown one task and one answer to it. Reply with yes or no.")
    assert question["content"] == ("# Task\n[user] 2+2?\n\n# Answer\n[assistant] 5\n\n"
                                   "Does the answer correctly and fully solve the task? Answer yes or no.")
    with pytest.raises(ValueError, match="one answer at a time"):
        verdict_messages(group_attempts([attempt("a", [user("q")], seq=1), attempt("b", [user("q")], seq=2)],
                                        JudgeConfig())[0][0], JudgeConfig())


class ScriptedTokens(Scripted):
    """A verdict-mode judge: replies are lists of (token, logprob) pairs (or a JudgeRequestError)."""

    def next_tokens(self, conversations):
        return self.chat(conversations, 1)


def test_verdict_scores_are_stored_as_judge_feedback_and_a_reply_with_no_yes_or_no_is_skipped(tmp_path):
    store = TraceStore(f"sqlite:///{tmp_path / 'traces.db'}")
    q = [user("Capital of France?")]
    store.add_traces([{"id": i, "messages": q, "response": said(a)}
                      for i, a in (("good", "Paris"), ("bad", "Lyon"), ("odd", "?"), ("down", "!"))])
    judge = ScriptedTokens([("Yes", math.log(0.6)), ("No", math.log(0.2))], [(" no", math.log(0.9))],
                           [("The", 0.0)], JudgeRequestError("HTTP 500"))
    cfg = CurationConfig(judge={"mode": "verdict"})
    report = run_judge(store, judge, cfg)
    assert (report.mode, report.groups, report.groups_by_kind, report.judged_groups) == ("verdict", 4, {"single": 4}, 2)
    assert report.retried_groups == 0 and report.skipped == {"no verdict": 1, "request failed": 1}
    assert report.verdicts == {"pass": 1, "fail": 1, "neutral": 0}
    assert judge.asked[0][1]["content"].endswith("Answer yes or no.")
    (fb,) = store.get("good").feedback
    assert (fb.source, round(fb.score, 12)) == ("judge", 0.75)
    assert json.loads(fb.text) | {"group": None} == {"judge": "scripted-judge", "mode": "verdict", "group": None,
                                                     "kind": "single", "size": 1,
                                                     "explanation": "P(yes)=0.6000 P(no)=0.2000"}
    assert [f.score for f in store.get("bad").feedback] == [0.0]
    assert store.get("odd").feedback == [] and store.get("down").feedback == []
    with pytest.raises(TypeError, match="verdict mode"):  # a client that cannot read token probabilities
        judge_groups(Scripted(), [], JudgeConfig(mode="verdict"))
    store.close()


def test_the_in_process_verdict_judge_scores_every_answer_with_one_forward_pass(tmp_path, one_thread):
    from flywheel.inference import LocalEngine
    from flywheel.models import TinySpec, build_tiny_model

    path = build_tiny_model(tmp_path / "m", TinySpec(hidden=32, layers=2, heads=4, ffn=64, max_positions=4096))
    engine = LocalEngine.from_path(str(path))
    store = TraceStore(f"sqlite:///{tmp_path / 'traces.db'}")
    q = [user("What is 2+2?")]
    store.add_traces([{"id": f"t{i}", "messages": q, "response": said(a)} for i, a in enumerate(("4", "5", "four"))])
    judge = SamplerJudge(engine, engine.tokenizer, "tiny")
    report = run_judge(store, judge, CurationConfig(judge={"mode": "verdict"}))
    assert (report.groups, report.judged_groups, report.scores_written, report.skipped) == (3, 3, 3, {})
    scores = [f.score for i in range(3) for f in store.get(f"t{i}").feedback if f.source == "judge"]
    assert len(scores) == 3 and all(0 <= s <= 1 for s in scores)
    # the forward pass's distribution is the engine's own: a yes/no token among the greedy token's top 20
    # alternatives has the same logprob there, one not among them is no likelier than the 20th
    groups, _ = group_attempts([Attempt("a", q, [said("4")])], JudgeConfig(mode="verdict"))
    question = verdict_messages(groups[0], JudgeConfig(mode="verdict"))
    (full,) = judge.next_tokens([question])
    (top,) = judge._next_tokens_sampled([question])
    top = dict(top)
    assert len(top) == 20 and all(abs(lp - top[t]) < 1e-4 if t in top else lp <= min(top.values()) + 1e-4
                                  for t, lp in full), (full, top)
    assert {t for t, _ in full} >= {"y", "Y", "n", "N"}  # a byte-level vocabulary: one letter a token
    store.close()
