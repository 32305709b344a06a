"""The SDK's request path, against httpx's mock transport: retries keep their idempotency key,
Retry-After is honoured, a refusal carries the server's error."""

from __future__ import annotations

import httpx
import pytest

from flywheel.client import Flywheel, FlywheelError
from flywheel.client import http as H


def client_with(handler, monkeypatch, retries=3):
    sleeps = []
    monkeypatch.setattr(H.time, "sleep", sleeps.append)
    fw = Flywheel("http://fw.test/v1", api_key="k-1", max_retries=retries)
    fw._http.client = httpx.Client(base_url="http://fw.test", transport=httpx.MockTransport(handler),
                                   headers=fw._http.client.headers)
    return fw, sleeps


def test_a_post_is_retried_with_one_idempotency_key_and_retry_after(monkeypatch):
    seen = []

    def handler(request):
        seen.append((request.headers["idempotency-key"], request.headers["authorization"]))
        if len(seen) == 1:
            return httpx.Response(429, headers={"retry-after": "2"}, json={"error": {"message": "slow down"}})
        if len(seen) == 2:
            return httpx.Response(503, json={"error": {"message": "busy"}})
        return httpx.Response(200, json={"id": "fb-1"})

    fw, sleeps = client_with(handler, monkeypatch)
    assert fw.traces.feedback("t-1", label="bad") == "fb-1"
    assert len({key for key, _ in seen}) == 1 and seen[0][1] == "Bearer k-1"
    assert sleeps == [2.0, 1.0]  # the server's Retry-After, then the backoff of attempt 2


def test_a_refusal_is_not_retried_and_carries_the_servers_error(monkeypatch):
    calls = []

    def handler(request):
        calls.append(request)
        return httpx.Response(400, json={"error": {"message": "model: unknown model 'x'", "type": "invalid_request_error",
                                                   "param": "model", "code": "model_not_found"}})

    fw, _ = client_with(handler, monkeypatch)
    with pytest.raises(FlywheelError) as info:
        fw.jobs.create(model="x", training_file="file-1", n_epochs=2)
    assert len(calls) == 1
    e = info.value
    assert (e.status, e.param, e.code) == (400, "model", "model_not_found") and "unknown model" in str(e)
    body = calls[0].read().decode()
    assert '"hyperparameters":{"n_epochs":2}' in body.replace(" ", "")


def test_retries_run_out_with_the_last_error(monkeypatch):
    fw, sleeps = client_with(lambda r: httpx.Response(502, text="bad gateway"), monkeypatch, retries=2)
    with pytest.raises(FlywheelError, match="502: bad gateway"):
        fw.jobs.list()
    assert sleeps == [0.5, 1.0]


def test_settings_read_the_environment(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_BASE_URL", "http://remote:9000/v1/")
    monkeypatch.setenv("FLYWHEEL_API_KEY", "secret")
    assert H.settings(None, None) == ("http://remote:9000", {"authorization": "Bearer secret"})
    assert H.settings("http://x", "k")[0] == "http://x"


def test_outcome_of_one_attempt():
    ok, busy, refused = (httpx.Response(s, headers=h) for s, h in ((200, {}), (429, {"retry-after": "3"}), (404, {})))
    assert H.outcome(1, 2, "GET /x", ok, None) is ok
    assert H.outcome(1, 2, "GET /x", busy, None) == 3.0  # the server's Retry-After
    assert H.outcome(2, 2, "GET /x", None, httpx.ConnectError("down")) == 1.0  # 0.5 s doubling
    with pytest.raises(FlywheelError, match="GET /x: down"):
        H.outcome(3, 2, "GET /x", None, httpx.ConnectError("down"))  # no retry left
    with pytest.raises(FlywheelError):
        H.outcome(1, 2, "GET /x", refused, None)  # a refusal is final at once


def test_the_async_client_retries_a_dropped_connection_with_the_same_key(monkeypatch):
    import asyncio

    from flywheel.client import AsyncFlywheel

    sleeps, keys = [], []

    async def no_sleep(s):
        sleeps.append(s)

    def handler(request):
        keys.append(request.headers["idempotency-key"])
        if len(keys) == 1:
            raise httpx.ConnectError("reset")
        return httpx.Response(200, json={"id": "file-1", "object": "file", "bytes": 1, "created_at": 0,
                                         "filename": "a.jsonl", "purpose": "fine-tune", "status": "processed"})

    async def main():
        fw = AsyncFlywheel("http://fw.test/v1", api_key="k-1")
        fw._http.client = httpx.AsyncClient(base_url="http://fw.test", transport=httpx.MockTransport(handler))
        try:
            return await fw.files.upload(b"{\"messages\": []}\n", filename="a.jsonl")
        finally:
            await fw.close()

    monkeypatch.setattr(H.asyncio, "sleep", no_sleep)
    created = asyncio.run(main())
    assert created.id == "file-1" and len(set(keys)) == 1 and len(keys) == 2 and sleeps == [0.5]
