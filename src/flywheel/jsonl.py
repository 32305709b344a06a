"""Reading JSONL with bounded memory: one line at a time, each at most `max_line_bytes`.

Every JSONL reader of flywheel (fine-tuning uploads and their checks, SFT data, trace imports)
reads lines through `read_lines`, so they agree on two things:

- a UTF-8 byte-order mark at the start of the file is dropped (Windows editors write one);
- a line longer than `max_line_bytes` is never held whole: it comes back as a `Line` with
  `too_long` set and empty `data`, the rest of it skipped in chunks, so a single 400 MB line
  costs `max_line_bytes` of memory, not 400 MB (nor the ~200x a tokenizer would take of it).

Lines end at b"\\n" (a trailing b"\\r" is dropped too); blank lines are yielded like any other
and the callers skip them, so line numbers always match an editor's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO, Iterator

BOM = b"\xef\xbb\xbf"
MAX_LINE_BYTES = 8 * 2 ** 20  # the default limit of one JSONL line (a row of a fine-tuning file, a trace)
SKIP_CHUNK = 2 ** 20  # bytes read at a time while skipping the rest of a line over the limit


@dataclass(frozen=True)
class Line:
    number: int  # 1-based, as an editor counts
    data: bytes  # without its line ending; b"" when too_long
    too_long: bool = False  # the line is longer than max_line_bytes (its data was not kept)
    size: int = 0  # bytes of the line without its ending (counted even when too_long)

    def is_blank(self) -> bool:
        return not self.too_long and not self.data.strip()


def read_lines(f: BinaryIO, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[Line]:
    """The lines of a binary stream, a leading BOM dropped; memory bounded by max_line_bytes."""
    if max_line_bytes < 1:
        raise ValueError(f"max_line_bytes must be >= 1, got {max_line_bytes}")
    number = 0
    first = True
    while True:
        raw = f.readline(max_line_bytes + 2)  # + room for "\r\n"
        if not raw:
            return
        number += 1
        if first:
            first = False
            if raw.startswith(BOM):
                raw = raw[len(BOM):]
        ended = raw.endswith(b"\n")
        data = raw.rstrip(b"\n")
        data = data[:-1] if data.endswith(b"\r") else data
        if len(data) <= max_line_bytes and (ended or len(raw) <= max_line_bytes):
            yield Line(number, data, size=len(data))
            continue
        size = len(data) + (0 if ended else _skip_rest_of_line(f))
        yield Line(number, b"", too_long=True, size=size)


def _skip_rest_of_line(f: BinaryIO) -> int:
    """Read past the end of the current line in SKIP_CHUNK pieces; the bytes skipped (without
    the line ending)."""
    skipped = 0
    while True:
        piece = f.readline(SKIP_CHUNK)
        if not piece:
            return skipped
        if piece.endswith(b"\n"):
            return skipped + len(piece.rstrip(b"\r\n"))
        skipped += len(piece)


def too_long_reason(line: Line, limit: int) -> str:
    """'52,428,800 bytes, over the limit of 8,388,608 bytes per line' (say which line before it)."""
    return f"{line.size:,} bytes, over the limit of {limit:,} bytes per line"
