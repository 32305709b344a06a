"""An uploaded JSONL file, streamed into the store's folder and checked on the way, with
bounded memory whatever its size (its longest line is read whole only up to the limit).

`stage_upload(source, folder, ...)` copies the upload's bytes into a temporary file beside
the stored files while it hashes them and checks that each line is a JSON object in UTF-8,
at most `max_line_bytes` long (a leading byte-order mark is accepted and kept). It returns a
`StagedUpload` that `JobStore.add_file` renames into place, or raises `UploadError` naming
the first bad line (and removes the temporary file). Nothing here knows of HTTP.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import orjson

from flywheel.jsonl import MAX_LINE_BYTES, read_lines, too_long_reason


class UploadError(ValueError):
    """An upload that is not JSONL of objects (the message names the file and line), or over
    the size limit (`too_large`)."""

    def __init__(self, message: str, too_large: bool = False):
        super().__init__(message)
        self.too_large = too_large


@dataclass(frozen=True)
class StagedUpload:
    path: Path  # the temporary file holding the bytes, beside the store's files
    bytes: int
    rows: int  # non-blank lines
    sha256: str  # of the bytes
    request_hash: str  # sha256 of filename \0 purpose \0 bytes: what an idempotent retry must match


class _Tee:
    """A binary reader that writes what it reads to `out` and hashes it, refusing past `limit`."""

    def __init__(self, source: BinaryIO, out: BinaryIO, hashes: list, limit: int, filename: str):
        self.source, self.out, self.hashes, self.limit, self.filename = source, out, hashes, limit, filename
        self.total = 0

    def readline(self, size: int = -1) -> bytes:
        data = self.source.readline(size)
        self.total += len(data)
        if self.total > self.limit:
            raise UploadError(f"file {self.filename!r} is over {self.limit} bytes; the limit is {self.limit}",
                              too_large=True)
        self.out.write(data)
        for h in self.hashes:
            h.update(data)
        return data


def stage_upload(source: BinaryIO, folder: Path, filename: str, purpose: str, *,
                 max_bytes: int, max_line_bytes: int = MAX_LINE_BYTES) -> StagedUpload:
    """Copy `source` into a temporary file in `folder`, checked line by line (see the module)."""
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".upload-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            content_hash = hashlib.sha256()
            request_hash = hashlib.sha256(b"\0".join([filename.encode(), purpose.encode(), b""]))
            tee = _Tee(source, out, [content_hash, request_hash], max_bytes, filename)
            rows = _check_lines(tee, filename, max_line_bytes)
            out.flush()
            os.fsync(out.fileno())
        if rows == 0:
            raise UploadError(f"file {filename!r} has no rows")
        return StagedUpload(Path(tmp), tee.total, rows, content_hash.hexdigest(), request_hash.hexdigest())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _check_lines(reader: _Tee, filename: str, max_line_bytes: int) -> int:
    rows = 0
    for line in read_lines(reader, max_line_bytes):
        if line.too_long:
            raise UploadError(f"file {filename!r}: line {line.number} is {too_long_reason(line, max_line_bytes)}")
        if line.is_blank():
            continue
        try:
            line.data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UploadError(f"file {filename!r} is not UTF-8 text: line {line.number}, byte {exc.start + 1}") \
                from None
        try:
            value = orjson.loads(line.data)
        except orjson.JSONDecodeError:
            raise UploadError(f"file {filename!r} is not JSONL: line {line.number} is not valid JSON") from None
        if not isinstance(value, dict):
            raise UploadError(f"file {filename!r} is not JSONL of objects: line {line.number} is a "
                              f"{type(value).__name__}")
        rows += 1
    return rows
