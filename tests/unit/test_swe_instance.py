"""The SWE-bench JSONL format (envs/swe/instance.py): every field checked, errors naming the
file, line and field, rows written back as read; predictions files likewise."""

from __future__ import annotations

import json

import pytest

from flywheel.envs.swe.instance import (DEFAULT_PYTEST, EnvironmentSpec, SWEFormatError, env_key, parse_instance,
                                        read_instances, read_predictions, write_instances)

SHA = "a" * 64


def row(**changes) -> dict:
    base = {"instance_id": "toolz__take__remove__1", "repo": "pytoolz/toolz", "base_commit": "pypi:toolz==1.2.0",
            "problem_statement": "test_take fails", "patch": "diff --git a/x.py b/x.py\n", "test_patch": "",
            "FAIL_TO_PASS": ["toolz/tests/test_itertoolz.py::test_take"],
            "PASS_TO_PASS": ["toolz/tests/test_itertoolz.py::test_drop", "tests/t.py::C::test_p[1-2]"],
            "version": "1.2.0",
            "source": {"kind": "pypi_sdist", "name": "toolz", "version": "1.2.0", "sha256": SHA}}
    base.update(changes)
    return {k: v for k, v in base.items() if v is not ...}


def write(tmp_path, *rows) -> str:
    p = tmp_path / "tasks.jsonl"
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(p)


def test_a_full_row_round_trips(tmp_path):
    r = row(hints_text="look at take", created_at="2026-12-06", bug_patch="diff --git a/x.py b/x.py\n",
            split="test", extra_field={"kept": True})
    inst = parse_instance(r)
    assert inst.environment == EnvironmentSpec((DEFAULT_PYTEST,))
    out = tmp_path / "out.jsonl"
    write_instances(out, [inst])
    again = read_instances(out)[0]
    assert again.row() == inst.row()
    assert again.row()["extra_field"] == {"kept": True}  # unknown fields are kept as they are


def test_json_string_test_lists_are_read_as_the_hub_stores_them():
    inst = parse_instance(row(FAIL_TO_PASS=json.dumps(["a/test_x.py::test_a"]), PASS_TO_PASS="[]"))
    assert inst.FAIL_TO_PASS == ["a/test_x.py::test_a"] and inst.PASS_TO_PASS == []


@pytest.mark.parametrize("changes, field", [
    (dict(instance_id=...), "'instance_id' is missing"),
    (dict(version=...), "'version' is missing"),
    (dict(patch=3), "'patch': expected a string"),
    (dict(patch="  "), "'patch' is empty"),
    (dict(instance_id="a/b"), "'instance_id'"),
    (dict(FAIL_TO_PASS=[]), "'FAIL_TO_PASS' is empty"),
    (dict(FAIL_TO_PASS="not json"), "'FAIL_TO_PASS': a string that is not a JSON list"),
    (dict(FAIL_TO_PASS=["test_x"]), "'FAIL_TO_PASS'[0]"),
    (dict(PASS_TO_PASS=["t/test_a.py::x", "t/test_a.py::x"]), "listed twice"),
    (dict(PASS_TO_PASS=["toolz/tests/test_itertoolz.py::test_take"]), "in FAIL_TO_PASS too"),
    (dict(split="dev"), "'split'"),
    (dict(source={"kind": "docker"}), "'source.kind'"),
    (dict(source={"kind": "pypi_sdist", "name": "toolz", "version": "1"}), "'source.sha256': required"),
    (dict(source={"kind": "pypi_sdist", "name": "t", "version": "1", "sha256": "xyz"}), "'source.sha256'"),
    (dict(source={"kind": "folder", "path": "/x", "root": "../up"}), "'source.root'"),
    (dict(source={"kind": "git", "url": "x"}), "unknown key 'url'"),
    (dict(environment={"pip": ["numpy"]}), "no pytest"),
    (dict(environment={"pip": ["pytest", "--index-url=http://x"]}), "options are not requirements"),
    (dict(environment={"conda": []}), "unknown key 'conda'"),
])
def test_a_bad_field_is_named_with_file_and_line(tmp_path, changes, field):
    path = write(tmp_path, row(instance_id="ok1"), "", row(**changes))
    with pytest.raises(SWEFormatError) as e:
        read_instances(path)
    assert str(e.value).startswith(f"{path}:3: ")
    assert field in str(e.value)


def test_bad_json_a_repeated_id_and_an_empty_file(tmp_path):
    with pytest.raises(SWEFormatError, match=r"tasks.jsonl:2: invalid JSON"):
        read_instances(write(tmp_path, row(), "{nope"))
    with pytest.raises(SWEFormatError, match=r"tasks.jsonl:2: field 'instance_id': .* repeats line 1"):
        read_instances(write(tmp_path, row(), row()))
    with pytest.raises(SWEFormatError, match="no instances"):
        read_instances(write(tmp_path, ""))
    with pytest.raises(SWEFormatError, match="no such file"):
        read_instances(tmp_path / "missing.jsonl")


def test_the_environment_key_follows_repo_version_and_requirements():
    a = env_key("o/r", "1.0", EnvironmentSpec())
    assert a == env_key("o/r", "1.0", EnvironmentSpec())
    assert len({a, env_key("o/r", "1.1", EnvironmentSpec()), env_key("o/s", "1.0", EnvironmentSpec()),
                env_key("o/r", "1.0", EnvironmentSpec(("pytest==8.0", "attrs")))}) == 4


def test_predictions_jsonl_and_json_list(tmp_path):
    p = tmp_path / "preds.jsonl"
    p.write_text(json.dumps({"instance_id": "a", "model_patch": "diff", "model_name_or_path": "m"}) + "\n\n"
                 + json.dumps({"instance_id": "b", "model_patch": None}) + "\n")
    got = read_predictions(p)
    assert [(x.instance_id, x.model_patch, x.model_name_or_path) for x in got] == [("a", "diff", "m"), ("b", "", "")]
    q = tmp_path / "preds.json"
    q.write_text(json.dumps([{"instance_id": "a", "model_patch": ""}]))
    assert read_predictions(q)[0].instance_id == "a"


@pytest.mark.parametrize("line, message", [
    ({"model_patch": "x"}, "preds.jsonl:2: field 'instance_id'"),
    ({"instance_id": "b"}, "preds.jsonl:2: field 'model_patch' is missing"),
    ({"instance_id": "b", "model_patch": 5}, "preds.jsonl:2: field 'model_patch': expected a string"),
    ({"instance_id": "a", "model_patch": ""}, "preds.jsonl:2: field 'instance_id': 'a' was predicted already"),
    ("[1, 2]", "preds.jsonl:2: expected a JSON object"),
])
def test_a_bad_prediction_is_named(tmp_path, line, message):
    p = tmp_path / "preds.jsonl"
    p.write_text(json.dumps({"instance_id": "a", "model_patch": ""}) + "\n"
                 + (line if isinstance(line, str) else json.dumps(line)) + "\n")
    with pytest.raises(SWEFormatError, match=message.replace("[", r"\[").replace("(", r"\(")):
        read_predictions(p)


def test_failure_messages_lose_only_object_addresses():
    from flywheel.envs.swe.synthesize import stable

    assert stable("assert <function f at 0x7f61089fc540> != <X object at 0x7F2A7AEEC540>") == \
        "assert <function f at 0x...> != <X object at 0x...>"
    assert stable("assert 0x10 == 0xff00 and 12345678 == 1") == "assert 0x10 == 0xff00 and 12345678 == 1"
