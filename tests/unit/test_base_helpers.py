"""The helpers at the base layer that several packages share: canonical JSON, UTC times,
crash points, `Closing`, and the one SQLAlchemy base and engine setup."""

from __future__ import annotations

import hashlib
import multiprocessing
import signal
from datetime import datetime, timedelta, timezone

import pytest

from flywheel.canonical import canonical
from flywheel.clock import utc_aware, utc_naive, utc_now
from flywheel.closing import Closing
from flywheel.crash_points import crash_point, kill_at
from flywheel.database import open_engine, writing
from flywheel.loop.curation_rules import prompt_hash

# ---- canonical JSON


def test_canonical_is_compact_with_sorted_keys_and_raw_unicode():
    assert canonical({"b": 1, "a": [1.5, None, True], "é": "ü"}) == '{"a":[1.5,null,true],"b":1,"é":"ü"}'
    assert canonical({"a": 0, "Z": 0, "B": 0}) == '{"B":0,"Z":0,"a":0}'  # code point order: upper case first
    assert canonical({"x": {"d": 1, "c": 2}}) == '{"x":{"c":2,"d":1}}'  # nested objects too
    assert canonical({1: "x"}) == '{"1":"x"}'
    assert canonical("a\nb\"") == '"a\\nb\\""'


def test_canonical_is_one_text_per_value():
    assert canonical({"a": 1, "b": [2, 3]}) == canonical({"b": [2, 3], "a": 1})
    assert canonical([float("nan"), float("inf")]) == "[null,null]"
    with pytest.raises(TypeError):
        canonical(2 ** 64)  # beyond 64 bits: not stored, refused


def test_prompt_hash_hashes_the_canonical_normal_form():
    # normal form of one user message: [role, lowercased text with whitespace collapsed, calls]
    assert prompt_hash("Hi  THERE ") == hashlib.sha256(b'[["user","hi there",[]]]').hexdigest()
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": '{"b":1,"a":2}'}}]}
    as_object = {**call, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 2, "b": 1}}}]}
    want = hashlib.sha256(b'[["assistant","",[["f",{"a":2,"b":1}]]]]').hexdigest()
    assert prompt_hash([call]) == prompt_hash([as_object]) == want


# ---- UTC times


def test_utc_naive_and_aware():
    plus_two = datetime(2024, 1, 1, 12, 30, tzinfo=timezone(timedelta(hours=2)))
    assert utc_naive(plus_two) == datetime(2024, 1, 1, 10, 30)
    assert utc_naive(datetime(2024, 1, 1, 10, 30)) == datetime(2024, 1, 1, 10, 30)  # naive is UTC already
    assert utc_aware(datetime(2024, 1, 1, 10, 30)) == plus_two
    now = utc_now()
    assert now.tzinfo is timezone.utc and utc_aware(utc_naive(now)) == now


# ---- crash points


def _reach(points: list[str], kill: str | None) -> None:
    kill_at(kill)
    for name in points:
        crash_point(name)
    raise SystemExit(3)


@pytest.mark.parametrize("kill, exitcode", [("b", -signal.SIGKILL), ("z", 3), (None, 3)])
def test_crash_point_kills_only_at_the_named_point(kill, exitcode):
    child = multiprocessing.get_context("fork").Process(target=_reach, args=(["a", "b", "c"], kill))
    child.start()
    child.join(30)
    assert child.exitcode == exitcode


def test_crash_points_do_nothing_by_default():
    crash_point("anything")  # no kill_at in this process: returns


# ---- Closing


class _Thing(Closing):
    def __init__(self):
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_closing_returns_itself_and_closes_however_the_block_ends():
    with _Thing() as t:
        assert isinstance(t, _Thing)
    assert t.closed == 1
    with pytest.raises(KeyError), _Thing() as t:
        raise KeyError("x")
    assert t.closed == 1


# ---- one declarative base, one engine setup


def test_a_write_without_foreign_keys_is_checked_before_it_commits(tmp_path):
    engine = open_engine(f"sqlite:///{tmp_path / 'fk.db'}")
    with writing(engine) as conn:
        conn.exec_driver_sql("CREATE TABLE parent (id INTEGER PRIMARY KEY)")
        conn.exec_driver_sql("CREATE TABLE child (id INTEGER PRIMARY KEY, "
                             "parent INTEGER REFERENCES parent (id) ON DELETE CASCADE)")
        conn.exec_driver_sql("INSERT INTO parent VALUES (1)")
        conn.exec_driver_sql("INSERT INTO child VALUES (1, 1)")
    with writing(engine, foreign_keys=False) as conn:  # what a table-recreating migration does
        conn.exec_driver_sql("CREATE TABLE parent_new (id INTEGER PRIMARY KEY)")
        conn.exec_driver_sql("INSERT INTO parent_new SELECT id FROM parent")
        conn.exec_driver_sql("DROP TABLE parent")
        conn.exec_driver_sql("ALTER TABLE parent_new RENAME TO parent")
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM child").scalar() == 1  # no cascade
    with pytest.raises(RuntimeError, match="foreign keys broken"), writing(engine, foreign_keys=False) as conn:
        conn.exec_driver_sql("INSERT INTO child VALUES (2, 99)")
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM child").scalar() == 1  # rolled back
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1  # and enforced again
    engine.dispose()
