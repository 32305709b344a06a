"""flywheel/jsonl.py's line reader by hand, and its two promises kept by every JSONL reader:
a leading byte-order mark is accepted (uploads, their per-method checks, SFT data, trace
imports), and a line over the limit is reported by number without being held whole."""

from __future__ import annotations

import io
import json

import pytest

from flywheel.config import SFTDataConfig
from flywheel.jobs.file_check import check_file
from flywheel.jobs.upload import UploadError, stage_upload
from flywheel.jsonl import BOM, Line, read_lines, too_long_reason
from flywheel.models.loading import load_tokenizer
from flywheel.models.tiny import TinySpec, build_tiny_model
from flywheel.traces import TraceStore, import_jsonl
from flywheel.train.sft_data import load_sft_examples

ROW = {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]}
BOM_FILE = BOM + (json.dumps(ROW) + "\n").encode() * 2


def lines(data: bytes, limit: int) -> list[Line]:
    return list(read_lines(io.BytesIO(data), limit))


def test_lines_by_hand():
    assert lines(BOM + b'{"a": 1}\r\n\n{"b": 2}', 100) == [
        Line(1, b'{"a": 1}', size=8), Line(2, b"", size=0), Line(3, b'{"b": 2}', size=8)]
    # a BOM is dropped only at the very start of the file
    assert lines(b"x\n" + BOM + b"y\n", 100)[1].data == BOM + b"y"


def test_a_line_over_the_limit_is_skipped_whole_and_the_next_read():
    data = b"12345\n" + b"x" * 100 + b"\n123456\nlast"
    assert lines(data, 5) == [Line(1, b"12345", size=5), Line(2, b"", too_long=True, size=100),
                              Line(3, b"", too_long=True, size=6), Line(4, b"last", size=4)]
    assert lines(b"x" * 7, 5) == [Line(1, b"", too_long=True, size=7)]  # no newline at the end
    assert lines(b"12345\r\n", 5) == [Line(1, b"12345", size=5)]  # the line ending is not counted
    assert too_long_reason(Line(9, b"", True, 12_345_678), 1000) == \
        "12,345,678 bytes, over the limit of 1,000 bytes per line"


def test_a_huge_line_is_never_held(monkeypatch):
    """Skipping reads SKIP_CHUNK at a time: no read asks for more than the limit + 2 bytes."""
    asked = []

    class Spy(io.BytesIO):
        def readline(self, size=-1):
            asked.append(size)
            return super().readline(size)

    monkeypatch.setattr("flywheel.jsonl.SKIP_CHUNK", 64)
    assert [ln.too_long for ln in read_lines(Spy(b"y" * 10_000 + b"\nok\n"), 100)] == [True, False]
    assert max(asked) == 102 and -1 not in asked


def test_an_upload_with_a_bom_is_accepted_and_kept(tmp_path):
    staged = stage_upload(io.BytesIO(BOM_FILE), tmp_path, "bom.jsonl", "fine-tune", max_bytes=2 ** 20)
    assert staged.rows == 2 and staged.path.read_bytes() == BOM_FILE


def test_an_upload_names_its_first_bad_line_and_leaves_nothing(tmp_path):
    with pytest.raises(UploadError, match=r"'x.jsonl': line 2 is 200 bytes, over the limit of 100 bytes per line"):
        stage_upload(io.BytesIO(b"{}\n" + b"a" * 200 + b"\n"), tmp_path, "x.jsonl", "fine-tune", max_bytes=2 ** 20,
                     max_line_bytes=100)
    with pytest.raises(UploadError, match=r"line 2 is not valid JSON"):
        stage_upload(io.BytesIO(b"{}\n{oops\n"), tmp_path, "x.jsonl", "fine-tune", max_bytes=2 ** 20)
    with pytest.raises(UploadError, match=r"not UTF-8 text: line 1, byte 3"):
        stage_upload(io.BytesIO(b'"a\xff"\n'), tmp_path, "x.jsonl", "fine-tune", max_bytes=2 ** 20)
    with pytest.raises(UploadError) as info:
        stage_upload(io.BytesIO(b"{}\n" * 100), tmp_path, "x.jsonl", "fine-tune", max_bytes=50)
    assert info.value.too_large
    assert list(tmp_path.iterdir()) == []  # no staged file left behind


def test_the_method_check_accepts_a_bom_and_reports_a_long_line():
    assert check_file(io.BytesIO(BOM_FILE), "supervised").rows == 2
    report = check_file(io.BytesIO(BOM_FILE + b"x" * 300 + b"\n"), "supervised", max_line_bytes=200)
    assert report.problems == [(3, "300 bytes, over the limit of 200 bytes per line")]


def test_sft_data_accepts_a_bom(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(BOM_FILE)
    tok = load_tokenizer(build_tiny_model(tmp_path / "tiny", TinySpec(hidden=32, layers=1, heads=2, ffn=64)))
    examples, report = load_sft_examples([str(path)], tok, SFTDataConfig(train=[str(path)], on_error="raise"))
    assert report.examples == 2 and len(examples) == 2


def test_a_trace_import_accepts_a_bom(tmp_path):
    record = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
              "response": {"role": "assistant", "content": "hello"}}
    path = tmp_path / "traces.jsonl"
    path.write_bytes(BOM + (json.dumps(record) + "\n").encode())
    with TraceStore(f"sqlite:///{tmp_path / 't.db'}") as store:
        report = import_jsonl(store, path)
        assert (report.added, report.errors) == (1, [])
