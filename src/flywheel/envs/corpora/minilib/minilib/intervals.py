"""Closed integer intervals as (start, end) tuples with start <= end."""


def normalize(interval):
    """Return the interval with its ends in order."""
    start, end = interval
    if start > end:
        start, end = end, start
    return (start, end)


def overlaps(a, b):
    """True when the closed intervals a and b share at least one point."""
    a, b = normalize(a), normalize(b)
    return a[0] <= b[1] and b[0] <= a[1]


def merge(intervals):
    """Merge overlapping or touching intervals; the result is sorted by start."""
    ordered = sorted(normalize(i) for i in intervals)
    merged = []
    for start, end in ordered:
        if merged and start <= merged[-1][1] + 1:
            last_start, last_end = merged[-1]
            merged[-1] = (last_start, max(last_end, end))
        else:
            merged.append((start, end))
    return merged


def insert(intervals, new):
    """Insert `new` into a list of intervals and merge the result."""
    return merge(list(intervals) + [new])


def total_length(intervals):
    """Number of integer points covered by the intervals (overlaps counted once)."""
    total = 0
    for start, end in merge(intervals):
        total += end - start + 1
    return total


def intersection(a, b):
    """The common part of two intervals, or None when they do not overlap."""
    if not overlaps(a, b):
        return None
    a, b = normalize(a), normalize(b)
    return (max(a[0], b[0]), min(a[1], b[1]))


def gaps(intervals, lo, hi):
    """The sub-intervals of [lo, hi] not covered by any interval."""
    result = []
    cursor = lo
    for start, end in merge(intervals):
        if end < lo or start > hi:
            continue
        if start > cursor:
            result.append((cursor, start - 1))
        cursor = max(cursor, end + 1)
    if cursor <= hi:
        result.append((cursor, hi))
    return result


def contains(intervals, point):
    """True when `point` lies in one of the intervals."""
    for start, end in intervals:
        start, end = normalize((start, end))
        if start <= point <= end:
            return True
    return False
