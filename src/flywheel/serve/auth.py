"""Who is calling: the tenant of a request's API key (`Authorization: Bearer <key>`), and how
fast a key may call.

`KeyAuth(keys)` is the app's `tenant_of` once keys exist (jobs/keys.py): a missing, unknown or
revoked key is a 401 in OpenAI's shape (`code: invalid_api_key`), which never echoes the key.
A key's lookups are cached for `cache_s` (a revoked key stops working within that time). Each
key has a token bucket (`rate_per_s` requests a second, bursts of `burst`): past it, a 429
with `Retry-After` (seconds until a token is back).
"""

from __future__ import annotations

import math
import threading
import time

from fastapi import Request

from flywheel.jobs.keys import Keys, key_hash
from flywheel.errors import OpenAIError


class TokenBucket:
    """`rate` tokens a second up to `burst`; `take(now)` is 0.0 when a token was taken, else
    the seconds until one is back (pure but for the state it keeps)."""

    def __init__(self, rate: float, burst: int, now: float):
        self.rate, self.burst = rate, burst
        self.tokens, self.at = float(burst), now

    def take(self, now: float) -> float:
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class KeyAuth:
    def __init__(self, keys: Keys, *, rate_per_s: float = 50.0, burst: int = 100, cache_s: float = 5.0,
                 clock=time.monotonic):
        self.keys, self.rate_per_s, self.burst, self.cache_s, self.clock = keys, rate_per_s, burst, cache_s, clock
        self._cache: dict[str, tuple[str | None, float]] = {}  # key hash -> (tenant, looked up at)
        self._buckets: dict[str, TokenBucket] = {}
        self._lock = threading.Lock()

    def __call__(self, request: Request) -> str:
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise OpenAIError("missing API key: send Authorization: Bearer <key> (flywheel keys create)", status=401,
                              code="invalid_api_key")
        digest = key_hash(key.strip())
        now = self.clock()
        with self._lock:
            cached = self._cache.get(digest)
        if cached is None or now - cached[1] > self.cache_s:
            cached = (self.keys.tenant_of(key.strip()), now)
            with self._lock:
                self._cache[digest] = cached
        tenant = cached[0]
        if tenant is None:
            raise OpenAIError("invalid API key (unknown or revoked)", status=401, code="invalid_api_key")
        with self._lock:
            bucket = self._buckets.setdefault(digest, TokenBucket(self.rate_per_s, self.burst, now))
            wait = bucket.take(now)
        if wait > 0:
            raise RateLimited(math.ceil(wait))
        return tenant


class RateLimited(OpenAIError):
    def __init__(self, retry_after_s: int):
        super().__init__(f"rate limit reached for this API key; retry after {retry_after_s} s", status=429,
                         type="rate_limit_error", code="rate_limit_exceeded")
        self.retry_after_s = retry_after_s
