"""Import traces from a JSONL file (one trace per line, the TraceIn shape) into a TraceStore.

Lines are read one at a time (flywheel/jsonl.py: a leading byte-order mark is dropped, a line
over MAX_LINE_BYTES is a bad line) and stored in batches; a bad line is reported as (line
number, reason) and the rest are stored. Re-running on the same file adds nothing: a line without its own
`idempotency_key` gets one derived from its content, `jsonl:<sha256 of the line>:<n>`, where
n counts earlier identical lines of the file. Unlike a key from the whole file's hash plus the
line number, this survives appending to the file and fixing a bad line (the lines already
stored keep their keys), while two identical lines in one file are still two traces.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from flywheel.jsonl import MAX_LINE_BYTES, read_lines, too_long_reason
from flywheel.traces.store import TraceStore


@dataclass
class ImportReport:
    path: Path
    lines: int = 0  # non-blank lines read
    added: int = 0
    duplicates: int = 0
    errors: list[tuple[int, str]] = field(default_factory=list)  # (1-based line number, reason)


def import_jsonl(store: TraceStore, path: str | Path, *, source: str | None = None,
                 batch_size: int = 500) -> ImportReport:
    """Store the traces of `path`; `source` (default `import:<file name>`) for records that name none."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    path = Path(path)
    source = source or f"import:{path.name}"
    report = ImportReport(path)
    seen: Counter[str] = Counter()
    batch: list[tuple[int, dict]] = []

    def flush() -> None:
        result = store.add_traces([record for _, record in batch], source=source)
        report.added += result.added
        report.duplicates += result.duplicates
        report.errors.extend((batch[r.index][0], r.reason or r.status) for r in result.rejected)
        batch.clear()

    with path.open("rb") as f:
        for read in read_lines(f, MAX_LINE_BYTES):
            if read.is_blank():
                continue
            number, line = read.number, read.data.strip()
            report.lines += 1
            if read.too_long:
                report.errors.append((number, f"the line is {too_long_reason(read, MAX_LINE_BYTES)}"))
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                report.errors.append((number, f"invalid JSON: {e}"))
                continue
            if isinstance(record, dict) and record.get("idempotency_key") is None:
                digest = hashlib.sha256(line).hexdigest()[:32]
                record["idempotency_key"] = f"jsonl:{digest}:{seen[digest]}"
                seen[digest] += 1
            batch.append((number, record))
            if len(batch) >= batch_size:
                flush()
    if batch:
        flush()
    report.errors.sort()
    return report
