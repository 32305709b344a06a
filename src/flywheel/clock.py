"""Time in UTC, as flywheel's stores keep it.

Databases hold naive UTC datetimes (`utc_naive`), records handed back are timezone-aware
UTC (`utc_aware`), and state files hold ISO 8601 text with the offset.
"""

from __future__ import annotations

from datetime import datetime, timezone


def utc_now() -> datetime:
    """Now, timezone-aware UTC."""
    return datetime.now(timezone.utc)


def utc_naive(t: datetime) -> datetime:
    """`t` as naive UTC (how the databases store times); a naive `t` is taken to be UTC already."""
    return t.astimezone(timezone.utc).replace(tzinfo=None) if t.tzinfo else t


def utc_aware(t: datetime) -> datetime:
    """A stored naive UTC time as a timezone-aware one."""
    return t.replace(tzinfo=timezone.utc)
