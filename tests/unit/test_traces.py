"""The trace store: validation per record, idempotency, feedback, tenants, SQLite settings,
concurrency, JSONL import. Tests that take `db_url` run on PostgreSQL too (tests/conftest.py)."""

from __future__ import annotations

import json
import threading
from collections import Counter
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from flywheel.cli.main import app
from flywheel.database import pragma
from flywheel.traces import (
    IdempotencyConflict, InvalidRecord, TraceIn, TraceNotFound, TraceStore, import_jsonl,
)
from flywheel.traces.tables import SCHEMA, TraceRow

TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def episode(i: int = 0, **extra) -> dict:
    """A served agent turn: a tool call, its result, the final answer."""
    record = {
        "model": "tiny", "model_version": "v3",
        "messages": [
            {"role": "system", "content": "Use the calculator."},
            {"role": "user", "content": f"What is {i} * 7?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{i}", "type": "function",
                 "function": {"name": "calc", "arguments": json.dumps({"expression": f"{i} * 7"})}}]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": str(i * 7)},
        ],
        "tools": TOOLS,
        "response": {"role": "assistant", "content": f"{i * 7}"},
        "usage": {"prompt_tokens": 40 + i, "completion_tokens": 9},
        "latency_ms": 12.5,
        "metadata": {"user": "u1", "logprobs": [-0.25, -1.5e-05], "ünï": "cödé"},
    }
    record.update(extra)
    return record


@pytest.fixture
def store(db_url):
    with TraceStore(db_url) as s:
        yield s


def test_a_trace_with_tools_and_tool_calls_round_trips(store):
    sent = episode(3, id="t-1", source="agent-x", created_at="2025-03-01T12:00:00+02:00")
    result = store.add_traces([sent])
    assert [r.status for r in result.results] == ["added"] and result.ids == ["t-1"]

    got = store.get("t-1")
    for field in ("messages", "tools", "response", "usage", "metadata", "model", "model_version", "latency_ms"):
        assert getattr(got, field) == sent[field], field
    assert got.messages[2]["tool_calls"][0]["function"]["arguments"] == '{"expression": "3 * 7"}'
    assert got.source == "agent-x"
    assert got.created_at == datetime(2025, 3, 1, 10, 0, tzinfo=timezone.utc)  # normalised to UTC
    assert got.idempotency_key == "t-1" and got.feedback == []
    with Session(store.engine) as session:  # the tables are a working ORM model too
        row = session.scalars(select(TraceRow).where(TraceRow.id == "t-1")).one()
        assert row.meta == sent["metadata"] and row.prompt_tokens == 43 and row.feedback == []


def test_defaults_id_source_and_time_and_accepts_the_typed_shape(store):
    before = datetime.now(timezone.utc) - timedelta(seconds=1)
    ids = store.add_traces([{"messages": [{"role": "user", "content": "hi"}]},
                            TraceIn(**episode(1))], source="serve").ids
    assert all(ids) and len(set(ids)) == 2
    first, second = store.get(ids[0]), store.get(ids[1])
    assert first.source == "serve" and first.created_at >= before
    assert first.response is None and first.tools is None and first.metadata == {}
    assert second.tools == TOOLS and second.messages == episode(1)["messages"]


def test_a_mixed_batch_stores_the_valid_records_and_names_the_bad_ones(store):
    class NotJson:
        pass

    batch = [
        episode(0),
        {"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]},
        episode(2),
        {"messages": [{"role": "user", "content": "hi"}], "colour": "red"},
        "not an object",
        {"messages": []},
        {"messages": [{"role": "user", "content": "hi"}], "response": {"role": "user", "content": "no"}},
        episode(7, metadata={"x": NotJson()}),
        {"messages": [{"role": "user", "content": "hi"}], "usage": {"prompt_tokens": "12", "completion_tokens": 1}},
        {"messages": [{"role": "tool", "content": "4", "tool_calls": []}]},
        episode(10),
        episode(11, created_at="0001-01-01T00:00:00+01:00"),  # valid, but before year 1 in UTC
    ]
    result = store.add_traces(batch)

    assert [r.status for r in result.results] == ["added", "invalid", "added"] + ["invalid"] * 7 + ["added", "invalid"]
    reasons = {r.index: str(r) for r in result.rejected}
    assert reasons[1] == ("record 1: messages[1].role: unknown role 'robot' "
                          "(valid: system, developer, user, assistant, tool)")
    assert reasons[3] == "record 3: colour: unknown field"
    assert reasons[4] == "record 4: expected a JSON object"
    assert reasons[5].startswith("record 5: messages: list should have at least 1 item")
    assert reasons[6] == "record 6: response: the response must be an assistant message, not user"
    assert reasons[7].startswith("record 7: metadata: not JSON")
    assert reasons[8] == "record 8: usage.prompt_tokens: input should be a valid integer"
    assert reasons[9] == "record 9: messages[0]: only assistant messages carry tool_calls, not tool"
    assert reasons[11] == "record 11: created_at: out of range once converted to UTC"
    assert store.count() == 3
    assert [t.usage["prompt_tokens"] for t in store.iter_traces()] == [40, 42, 50]


def test_a_raw_completion_trace_keeps_its_prompt_text(store):
    """`prompt` (a /v1/completions trace) instead of `messages`: stored and read back as text."""
    result = store.add_traces([
        {"id": "raw", "prompt": "12+34=", "response": {"role": "assistant", "content": "46"}},
        {"prompt": "1+1=", "messages": [{"role": "user", "content": "1+1="}]},
        {"response": {"role": "assistant", "content": "2"}},
        {"prompt": ""},
    ])
    assert [r.status for r in result.results] == ["added", "invalid", "invalid", "invalid"]
    reasons = [str(r) for r in result.rejected]
    assert reasons[0] == ("record 1: a trace needs exactly one of 'messages' (a chat trace) and 'prompt' "
                          "(a raw completion), not both")
    assert reasons[1] == ("record 2: a trace needs exactly one of 'messages' (a chat trace) and 'prompt' "
                          "(a raw completion)")
    assert reasons[2].startswith("record 3: prompt: string should have at least 1 character")
    trace = store.get("raw")
    assert trace.prompt == "12+34=" and trace.messages == [] and trace.response["content"] == "46"
    assert store.add_traces([{"id": "raw", "prompt": "12+34=", "response": {"role": "assistant", "content": "46"}}]
                            ).results[0].status != "conflict"  # a retry of the same content is a no-op


def test_writers_of_one_process_queue_for_a_bounded_time(store, monkeypatch):
    """Writers of one process take turns on a lock; one that waits longer than WRITE_WAIT_S
    (another process holding the database, say) gives up without writing anything."""
    from flywheel.traces import TraceStoreBusy
    from flywheel.traces import store as module

    monkeypatch.setattr(module, "WRITE_WAIT_S", 0.2)
    with store._write_lock:  # the turn of another writer that does not end
        with pytest.raises(TraceStoreBusy, match="nothing was written"):
            store.add_traces([episode(1)])
    assert store.count() == 0 and store.add_traces([episode(1)]).added == 1


def test_a_tools_list_is_validated_until_it_is_known_good(store):
    bad_tools = [{"type": "function", "function": {"name": "", "parameters": {"type": "object"}}}]
    result = store.add_traces([episode(1), episode(2, tools=bad_tools), episode(3, tools=bad_tools)])
    assert [r.status for r in result.results] == ["added", "invalid", "invalid"]
    assert result.results[1].reason == "tools[0].function.name: string should have at least 1 character"


def test_a_retry_with_the_same_key_and_content_is_a_no_op(store):
    batch = [episode(i, idempotency_key=f"req-{i}") for i in range(3)] + [episode(9, id="fixed")]
    first = store.add_traces(batch)
    again = store.add_traces(batch)
    assert first.added == 4 and again.added == 0 and again.duplicates == 4
    assert again.ids == first.ids  # generated ids are found again through the key
    # twice in one batch: the second copy is a duplicate of the first
    twice = store.add_traces([episode(5, idempotency_key="k5"), episode(5, idempotency_key="k5")])
    assert [r.status for r in twice.results] == ["added", "duplicate"] and twice.ids[0] == twice.ids[1]
    assert store.count() == 5


def test_a_retry_with_the_same_key_and_other_content_is_a_conflict(store):
    stored = store.add_traces([episode(1, idempotency_key="req-1"), episode(2, id="t-2")]).ids
    result = store.add_traces([episode(1, idempotency_key="req-1", latency_ms=99.0),  # same key, new content
                               episode(3, id="t-2", idempotency_key="other"),  # id taken under another key
                               episode(4)])
    assert [r.status for r in result.results] == ["conflict", "conflict", "added"]
    assert "idempotency key 'req-1' is already used by trace" in result.results[0].reason
    assert "id 't-2' is taken" in result.results[1].reason
    assert store.get(stored[0]).latency_ms == 12.5  # the first content is kept
    assert store.count() == 3


def test_feedback_of_every_kind_is_stored_in_order(store):
    trace_id = store.add_traces([episode(1)]).ids[0]
    correction = {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "calc", "arguments": {"expression": "1 * 7"}}}]}
    verifier = {"env": "calculator", "task": {"id": "c-1", "prompt": "What is 1 * 7?", "answer": 7}}
    ids = [
        store.add_feedback(trace_id, {"score": 0.0}),
        store.add_feedback(trace_id, {"label": "wrong_tool", "text": "it should have used calc twice"}),
        store.add_feedback(trace_id, {"correction": correction}),
        store.add_feedback(trace_id, {"verifier": verifier, "created_at": "2025-01-02T03:04:05Z"}),
    ]
    fb = store.get(trace_id).feedback
    assert [f.id for f in fb] == ids and all(f.trace_id == trace_id for f in fb)
    assert fb[0].score == 0.0 and fb[0].label is None
    assert (fb[1].label, fb[1].text) == ("wrong_tool", "it should have used calc twice")
    assert fb[2].correction == correction
    assert (fb[3].verifier.env, fb[3].verifier.task) == ("calculator", verifier["task"])
    assert fb[3].created_at == datetime(2025, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


def test_feedback_retries_validation_and_unknown_traces(store):
    trace_id = store.add_traces([episode(1)]).ids[0]
    first = store.add_feedback(trace_id, {"score": 1.0, "idempotency_key": "fb-1"})
    assert store.add_feedback(trace_id, {"score": 1.0, "idempotency_key": "fb-1"}) == first
    with pytest.raises(IdempotencyConflict, match="'fb-1'"):
        store.add_feedback(trace_id, {"score": 0.5, "idempotency_key": "fb-1"})
    with pytest.raises(InvalidRecord, match="at least one of score"):
        store.add_feedback(trace_id, {})
    with pytest.raises(InvalidRecord, match=r"correction: a correction must be an assistant message"):
        store.add_feedback(trace_id, {"correction": {"role": "user", "content": "x"}})
    with pytest.raises(InvalidRecord, match=r"verifier.env: required"):
        store.add_feedback(trace_id, {"verifier": {"task": {}}})
    with pytest.raises(InvalidRecord, match=r"created_at: out of range"):
        store.add_feedback(trace_id, {"score": 1.0, "created_at": "9999-12-31T23:59:59-01:00"})
    with pytest.raises(TraceNotFound, match="no trace with id 'nope'"):
        store.add_feedback("nope", {"score": 1.0})
    with pytest.raises(TraceNotFound, match="no trace with id 'nope'"):
        store.get("nope")
    assert len(store.get(trace_id).feedback) == 1


def test_iter_traces_streams_in_pages_with_filters(store):
    old = datetime(2024, 1, 1, tzinfo=timezone.utc)
    ids = store.add_traces([episode(i, created_at=(old + timedelta(days=i)).isoformat(),
                                    source="a" if i % 2 else "b") for i in range(7)]).ids
    store.add_feedback(ids[1], {"score": 1.0})
    store.add_feedback(ids[4], {"label": "bad"})
    traces = list(store.iter_traces(batch_size=2))
    assert [t.id for t in traces] == ids
    assert [t.id for t in store.iter_traces(after_seq=traces[4].seq, batch_size=1)] == ids[5:]
    assert [t.id for t in store.iter_traces(source="a", batch_size=1)] == ids[1::2]
    assert [t.id for t in store.iter_traces(since=old + timedelta(days=5))] == ids[5:]
    assert [t.id for t in store.iter_traces(with_feedback=True, batch_size=1)] == [ids[1], ids[4]]
    assert [t.feedback[0].label for t in store.iter_traces(with_feedback=True)] == [None, "bad"]
    assert len(list(store.iter_traces(with_feedback=False, batch_size=3))) == 5
    assert store.count(source="b") == 4 and store.count(with_feedback=True) == 2


def test_feedback_after_pages_through_new_feedback_on_traces_after_a_cursor(store):
    ids = store.add_traces([episode(i) for i in range(4)]).ids
    cursor = store.get(ids[1]).seq  # traces 2 and 3 come after it
    fb = [store.add_feedback(ids[i], {"score": float(i)}) for i in (0, 2, 3, 2)]
    rows = list(store.feedback_after(batch_size=1))
    assert [f.id for _, f in rows] == fb and [s for s, _ in rows] == sorted(s for s, _ in rows)
    assert [f.id for _, f in store.feedback_after(after_trace_seq=cursor, batch_size=2)] == fb[1:]
    assert [f.score for _, f in store.feedback_after(rows[2][0], after_trace_seq=cursor)] == [2.0]
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        next(store.feedback_after(batch_size=0))


def test_sqlite_runs_in_wal_mode(tmp_path):
    url = f"sqlite:///{tmp_path / 'deep' / 'traces.db'}"
    with TraceStore(url) as store:
        assert pragma(store.engine, "journal_mode") == "wal"
        assert pragma(store.engine, "synchronous") == "1"  # NORMAL
        assert pragma(store.engine, "foreign_keys") == "1"
        assert store.stats().schema_revision == SCHEMA.head()


def test_default_location_is_flywheel_data_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with TraceStore() as store:
        store.add_traces([episode(1)])
    assert (tmp_path / "flywheel-data" / "traces.db").is_file()


def test_two_writers_at_once_lose_nothing_and_store_a_shared_key_once(db_url):
    stores = [TraceStore(db_url), TraceStore(db_url)]  # separate engines and connections, like two processes
    results: dict[int, list] = {0: [], 1: []}
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        try:
            for b in range(10):
                own = [episode(i, idempotency_key=f"w{w}-{b}-{i}") for i in range(30)]
                shared = [episode(i, idempotency_key=f"shared-{b}-{i}") for i in range(5)]  # both send these
                results[w].append(stores[w].add_traces(own + shared))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    batches = results[0] + results[1]
    assert all(r.ok for r in batches)
    own = [i for r in batches for i in r.ids[:30]]
    shared = Counter((i, r.results[30 + k].status) for r in batches for k, i in enumerate(r.ids[30:]))
    assert len(set(own)) == 600
    assert sorted(Counter(i for i, _ in shared).values()) == [2] * 50  # both writers got the same id per key
    assert Counter(status for _, status in shared.elements()) == {"added": 50, "duplicate": 50}
    assert stores[0].count() == 650
    assert {t.id for t in stores[1].iter_traces(batch_size=128)} == set(own) | {i for i, _ in shared}
    for s in stores:
        s.close()


def test_import_jsonl_reports_bad_lines_stores_the_rest_and_reruns_add_nothing(tmp_path, db_url):
    db = db_url
    path = tmp_path / "episodes.jsonl"
    lines = [json.dumps(episode(0)), "", json.dumps(episode(1)),
             '{"messages": [{"role": "robot", "content": "x"}]}', "{not json", json.dumps(episode(1))]
    path.write_text("\n".join(lines) + "\n")
    runner = CliRunner()

    result = runner.invoke(app, ["traces", "import", str(path), "--db", db, "--batch-size", "2"])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"{path}:4: messages[0].role: unknown role 'robot' (valid: system, developer, user, assistant, tool)",
        f"{path}:5: invalid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
    ]
    assert result.stdout == f"{path}: 3 added, 0 already stored, 2 rejected (5 lines)\n"
    with TraceStore(db) as store:  # two identical lines are two traces
        assert store.count() == 3 and {t.source for t in store.iter_traces()} == {"import:episodes.jsonl"}

    again = runner.invoke(app, ["traces", "import", str(path), "--db", db])
    assert again.exit_code == 1 and again.stdout == f"{path}: 0 added, 3 already stored, 2 rejected (5 lines)\n"

    # fixing the bad lines and appending one adds exactly those
    lines[3], lines[4] = json.dumps(episode(4)), json.dumps(episode(5))
    path.write_text("\n".join([*lines, json.dumps(episode(6))]) + "\n")
    fixed = runner.invoke(app, ["traces", "import", str(path), "--db", db, "--source", "agent-x"])
    assert fixed.exit_code == 0 and fixed.stdout == f"{path}: 3 added, 3 already stored, 0 rejected (6 lines)\n"

    stats = runner.invoke(app, ["traces", "stats", "--db", db])
    assert stats.exit_code == 0
    assert "traces          6\n" in stats.stdout
    assert "source          agent-x: 3\nsource          import:episodes.jsonl: 3\n" in stats.stdout
    assert f"tokens          {40 + 41 + 41 + 44 + 45 + 46} prompt, 54 completion\n" in stats.stdout


def test_import_keeps_a_records_own_key_and_refuses_a_missing_file(tmp_path, store):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(episode(1, idempotency_key="own")) + "\n")
    report = import_jsonl(store, path)
    assert (report.added, report.errors) == (1, [])
    retry = store.add_traces([episode(1, idempotency_key="own")])
    assert retry.duplicates == 1 and store.get(retry.ids[0]).idempotency_key == "own"
    missing = CliRunner().invoke(app, ["traces", "import", str(tmp_path / "nope.jsonl")])
    assert missing.exit_code == 2 and "does not exist" in missing.output
