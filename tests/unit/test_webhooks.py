"""Webhook signatures (Standard Webhooks) and delivery retries."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from types import SimpleNamespace

from flywheel.jobs.webhooks import deliver, sign, verify

SECRET = "whsec_" + base64.b64encode(b"k" * 24).decode()


def test_the_signature_is_hmac_sha256_of_id_timestamp_and_body():
    body = b'{"a":1}'
    expected = base64.b64encode(hmac.new(b"k" * 24, b"msg_1.1700000000." + body, hashlib.sha256).digest()).decode()
    assert sign(SECRET, "msg_1", 1700000000, body) == "v1," + expected


def test_verify_checks_signature_and_freshness():
    body, ts = b"{}", int(time.time())
    headers = {"webhook-id": "m", "webhook-timestamp": str(ts), "webhook-signature": sign(SECRET, "m", ts, body)}
    assert verify(SECRET, headers, body)
    assert not verify(SECRET, headers, b"{ }")
    assert not verify(SECRET, {**headers, "webhook-timestamp": str(ts - 3600),
                               "webhook-signature": sign(SECRET, "m", ts - 3600, body)}, body)
    assert not verify(SECRET, {"webhook-id": "m"}, body)


def test_delivery_retries_then_reports():
    calls, pauses = [], []

    def post(url, content, headers):
        calls.append((url, json.loads(content), headers))
        return SimpleNamespace(status_code=503 if len(calls) < 3 else 204)

    endpoint = {"url": "http://hook.test/x", "secret": SECRET}
    out = deliver(endpoint, "fine_tuning.job.succeeded", "ftjob-1", post, sleep=pauses.append)
    assert out == "Webhook fine_tuning.job.succeeded delivered to http://hook.test/x"
    assert pauses == [0.5, 1.0] and len({h["webhook-id"] for _, _, h in calls}) == 1  # one event, retried
    url, payload, headers = calls[-1]
    assert payload["type"] == "fine_tuning.job.succeeded" and payload["data"] == {"id": "ftjob-1"}
    assert verify(SECRET, headers, json.dumps(payload).encode())
    failing = deliver(endpoint, "fine_tuning.job.failed", "ftjob-2", lambda *a, **k: (_ for _ in ()).throw(OSError("down")),
                      attempts=2, sleep=lambda s: None)
    assert failing.endswith("failed after 2 attempts: OSError: down")
