"""The SDK's one request path: base URL and key from arguments or the environment, an
`Idempotency-Key` on every POST (the same key on each retry, so a retried POST never makes a
second object), retries with backoff on connection errors, 429, 500, 502, 503 and 504 (a 429's
`Retry-After` is honoured), and `FlywheelError` carrying the server's error on anything else."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import uuid
from typing import Any

import httpx

RETRY_STATUS = {429, 500, 502, 503, 504}
DEFAULT_BASE_URL = "http://127.0.0.1:8000"


class FlywheelError(Exception):
    """The server refused a request: `status` (0 when it could not be reached), and its error's
    `message`, `code`, `param` and `type`."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type: str | None = None):
        super().__init__(f"{status}: {message}" if status else message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type

    @classmethod
    def from_response(cls, r: httpx.Response) -> FlywheelError:
        try:
            err = r.json()["error"]
            return cls(r.status_code, err.get("message") or r.text, code=err.get("code"), param=err.get("param"),
                       type=err.get("type"))
        except (ValueError, KeyError, TypeError):
            return cls(r.status_code, r.text[:500] or r.reason_phrase)


def settings(base_url: str | None, api_key: str | None) -> tuple[str, dict[str, str]]:
    """(base URL without a trailing /v1, headers): FLYWHEEL_BASE_URL and FLYWHEEL_API_KEY by default."""
    url = (base_url or os.environ.get("FLYWHEEL_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
    url = url.removesuffix("/v1")
    key = api_key or os.environ.get("FLYWHEEL_API_KEY")
    return url, ({"authorization": f"Bearer {key}"} if key else {})


def backoff_s(attempt: int, r: httpx.Response | None) -> float:
    """Seconds before retry `attempt` (1-based): the server's Retry-After when it gave one, else
    0.5 s doubling, at most 8 s."""
    if r is not None:
        try:
            return min(60.0, float(r.headers["retry-after"]))
        except (KeyError, ValueError):
            pass
    return min(8.0, 0.5 * 2 ** (attempt - 1))


def prepare(method: str, headers: dict[str, str] | None) -> dict[str, str]:
    headers = dict(headers or {})
    if method == "POST":
        headers.setdefault("idempotency-key", uuid.uuid4().hex)
    return headers


def outcome(attempt: int, max_retries: int, what: str, r: httpx.Response | None,
            exc: Exception | None) -> httpx.Response | float:
    """What attempt `attempt` (1-based) of `what` ("GET <url>") came to: the response to
    return, or the seconds to wait before the next attempt; FlywheelError when it failed and
    no retry is left, or the server refused for good (an answer of 400 or more outside RETRY_STATUS)."""
    if exc is not None:
        if attempt > max_retries:
            raise FlywheelError(0, f"{what}: {exc}") from None
    elif r.status_code < 400:
        return r
    elif r.status_code not in RETRY_STATUS or attempt > max_retries:
        raise FlywheelError.from_response(r)
    return backoff_s(attempt, r)


class SyncHTTP:
    def __init__(self, base_url: str | None, api_key: str | None, timeout: float, max_retries: int):
        url, headers = settings(base_url, api_key)
        self.client = httpx.Client(base_url=url, headers=headers, timeout=timeout)
        self.max_retries = max_retries

    def request(self, method: str, path: str, *, headers: dict[str, str] | None = None, **kw: Any) -> httpx.Response:
        headers = prepare(method, headers)
        for attempt in itertools.count(1):
            r = exc = None
            try:
                r = self.client.request(method, path, headers=headers, **kw)
            except httpx.TransportError as e:
                exc = e
            step = outcome(attempt, self.max_retries, f"{method} {self.client.base_url}{path}", r, exc)
            if isinstance(step, httpx.Response):
                return step
            time.sleep(step)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.client.close()


class AsyncHTTP:
    def __init__(self, base_url: str | None, api_key: str | None, timeout: float, max_retries: int):
        url, headers = settings(base_url, api_key)
        self.client = httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout)
        self.max_retries = max_retries

    async def request(self, method: str, path: str, *, headers: dict[str, str] | None = None,
                      **kw: Any) -> httpx.Response:
        headers = prepare(method, headers)
        for attempt in itertools.count(1):
            r = exc = None
            try:
                r = await self.client.request(method, path, headers=headers, **kw)
            except httpx.TransportError as e:
                exc = e
            step = outcome(attempt, self.max_retries, f"{method} {self.client.base_url}{path}", r, exc)
            if isinstance(step, httpx.Response):
                return step
            await asyncio.sleep(step)
        raise AssertionError("unreachable")

    async def close(self) -> None:
        await self.client.aclose()
