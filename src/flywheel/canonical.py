"""Canonical JSON: one text per JSON value, so equal values hash equal.

`canonical(value)` is compact JSON with keys sorted (by code point) and non-ASCII kept as is.
It is the text the trace store stores and hashes and the text curation hashes prompts by.
NaN and infinities become null; non-string keys become strings; an integer beyond 64 bits
(or anything else that is not JSON) raises TypeError.
"""

from __future__ import annotations

from typing import Any

import orjson

_OPTIONS = orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS


def canonical(value: Any) -> str:
    """Compact JSON with sorted keys (orjson: the ingestion rate needs its speed; decoded to
    str at once, which is faster than keeping orjson's bytes)."""
    return orjson.dumps(value, option=_OPTIONS).decode()
