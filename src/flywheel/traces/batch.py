"""The database-free half of trace ingestion: a batch of records made ready to be written.

`TraceStore.add_traces` = `prepare_traces` (validation, canonical JSON, content hashes, ids:
pure CPU, ~all of the work) + `TraceStore.add_prepared` (the idempotency check and the
INSERTs, in one write transaction). The split lets the first half run wherever a core is
free: a server hands whole request bodies to worker processes (`prepare_body`, see
flywheel/serve/ingest_pool.py) and only writes in its own process, so ingestion is not
held to one core by the GIL. A `PreparedBatch` is plain data and pickles.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from flywheel.clock import utc_naive, utc_now
from flywheel.process import cycle_collector_paused
from flywheel.traces.encoding import NotJSON, decode_json, new_trace_ids, trace_row, validate_trace
from flywheel.traces.results import RecordResult
from flywheel.traces.schema import describe


class NotABatch(ValueError):
    """A request body that is JSON but not a batch of traces."""


@dataclass(frozen=True)
class PreparedBatch:
    size: int  # records in the batch
    invalid: list[RecordResult]  # the records validation refused, in index order
    rows: list[tuple[int, tuple]]  # (index, `traces` row in TRACE_COLUMNS order) of every valid record


def prepare_traces(records: Iterable[Any], default_source: str, now: datetime | None = None) -> PreparedBatch:
    """Validate each record on its own and build the rows of the valid ones.

    default_source: for records that name none. now: the time of records that carry no
    created_at (default: the current time)."""
    now = utc_naive(now or utc_now())
    invalid: list[RecordResult] = []
    valid = []  # (index, record as validated, record as sent, canonical JSON of its fields)
    size = 0
    for index, record in enumerate(records):
        size += 1
        try:
            trace, encoded = validate_trace(record)
            valid.append((index, trace, record, encoded))
        except ValidationError as e:
            invalid.append(RecordResult(index, "invalid", reason=describe(e)))
        except NotJSON as e:
            invalid.append(RecordResult(index, "invalid", reason=str(e)))
    new_ids = iter(new_trace_ids(sum(not trace.get("id") for _, trace, _, _ in valid)))
    rows: list[tuple[int, tuple]] = []
    for index, trace, sent, encoded in valid:
        new_id = None if trace.get("id") else next(new_ids)
        try:
            rows.append((index, trace_row(trace, sent, encoded, default_source, now, new_id)))
        except NotJSON as e:  # a scalar field orjson cannot write (a lone surrogate)
            invalid.append(RecordResult(index, "invalid", reason=str(e)))
        except OverflowError:  # e.g. 0001-01-01T00:00:00+01:00 is before year 1 in UTC
            invalid.append(RecordResult(index, "invalid", reason="created_at: out of range once converted to UTC"))
    invalid.sort(key=lambda r: r.index)
    return PreparedBatch(size, invalid, rows)


def batch_records(body: Any) -> list[Any]:
    """The records of a decoded body: a JSON list, or an object with a list under "traces"."""
    records = body.get("traces") if isinstance(body, dict) else body
    if not isinstance(records, list):
        raise NotABatch('expected a JSON list of traces or {"traces": [...]}')
    return records


def prepare_body(raw: bytes, default_source: str, now: datetime) -> PreparedBatch:
    """A POST /v1/traces body, decoded and prepared; raises NotJSON or NotABatch.

    A module-level function of bytes, a str and a datetime: what a worker process is sent."""
    return prepare_traces(batch_records(decode_json(raw)), default_source, now)


def prepare_body_in_worker(raw: bytes, default_source: str, now: datetime) -> PreparedBatch:
    """`prepare_body` in an ingestion worker process (serve/ingest_pool.py), the cycle
    collector paused: a 500-record body makes ~10^5 containers, freed by reference counting
    when the batch is done, which would set off collections that walk every imported object
    on the way. It runs between bodies instead. Here, not in the pool's module, so that a
    worker imports flywheel.traces only (the service package would bring torch)."""
    with cycle_collector_paused():
        return prepare_body(raw, default_source, now)
