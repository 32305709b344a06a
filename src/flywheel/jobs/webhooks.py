"""Webhooks: a tenant's endpoints, told when its jobs end.

An endpoint is a URL, the events it wants (`fine_tuning.job.succeeded`, `.failed`,
`.cancelled`; all three by default) and a secret (`whsec_` + base64 of 24 random bytes, shown
once). A delivery is a POST of `{"object": "event", "id", "type", "created_at", "data": {"id":
job id}}` signed as Standard Webhooks specifies: headers `webhook-id`, `webhook-timestamp`
(unix seconds) and `webhook-signature: v1,<base64 HMAC-SHA256 of "<id>.<timestamp>.<body>"
under the secret's bytes>`; a receiver checks it with `verify`. Delivery retries a failed POST
(an error or a status >= 300) `attempts` times with a doubling pause; the job's events record
the outcome.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from typing import Any, Callable

from sqlalchemy import delete, insert, select

from flywheel.clock import utc_naive, utc_now
from flywheel.database import writing
from flywheel.jobs.store import NotFound, new_id
from flywheel.jobs.tables import WebhookRow

EVENTS = ("fine_tuning.job.succeeded", "fine_tuning.job.failed", "fine_tuning.job.cancelled")


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def verify(secret: str, headers: dict[str, str], body: bytes, tolerance_s: float = 300.0) -> bool:
    """A receiver's check: the signature matches and the timestamp is recent."""
    try:
        ts = int(headers["webhook-timestamp"])
        expected = sign(secret, headers["webhook-id"], ts, body)
    except (KeyError, ValueError):
        return False
    fresh = abs(time.time() - ts) <= tolerance_s
    return fresh and any(hmac.compare_digest(expected, s) for s in headers.get("webhook-signature", "").split())


class Webhooks:
    def __init__(self, engine):
        self.engine = engine

    def create(self, tenant: str, url: str, events: list[str] | None = None) -> dict[str, Any]:
        """The endpoint with its secret (shown only in this answer)."""
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http(s) URL, got {url!r}")
        events = list(events or EVENTS)
        unknown = [e for e in events if e not in EVENTS]
        if unknown:
            raise ValueError(f"unknown event {unknown[0]!r}; events: {', '.join(EVENTS)}")
        row = dict(id=new_id("wh"), tenant=tenant, url=url, events=events, created_at=utc_naive(utc_now()),
                   secret="whsec_" + base64.b64encode(secrets.token_bytes(24)).decode())
        with writing(self.engine) as conn:
            conn.execute(insert(WebhookRow).values(**row))
        return row

    def list(self, tenant: str) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(WebhookRow.id, WebhookRow.url, WebhookRow.events, WebhookRow.created_at)
                                .where(WebhookRow.tenant == tenant).order_by(WebhookRow.created_at)).all()
        return [dict(r._mapping) for r in rows]

    def delete(self, tenant: str, webhook_id: str) -> None:
        with writing(self.engine) as conn:
            if conn.execute(delete(WebhookRow).where(WebhookRow.id == webhook_id,
                                                     WebhookRow.tenant == tenant)).rowcount != 1:
                raise NotFound(f"no webhook endpoint {webhook_id!r}", "webhook_id")

    def endpoints(self, tenant: str, event: str) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(WebhookRow.__table__).where(WebhookRow.tenant == tenant)).all()
        return [dict(r._mapping) for r in rows if event in r.events]


def deliver(endpoint: dict[str, Any], event: str, job_id: str, post: Callable[..., Any], *, attempts: int = 4,
            pause_s: float = 0.5, sleep: Callable[[float], None] = time.sleep) -> str:
    """POST the event to one endpoint; a line saying how it went (for the job's events).
    post(url, content=, headers=) -> a response with .status_code (httpx.post)."""
    msg_id = new_id("evt")
    ts = int(time.time())
    body = json.dumps({"object": "event", "id": msg_id, "type": event, "created_at": ts,
                       "data": {"id": job_id}}).encode()
    headers = {"content-type": "application/json", "webhook-id": msg_id, "webhook-timestamp": str(ts),
               "webhook-signature": sign(endpoint["secret"], msg_id, ts, body)}
    last = ""
    for attempt in range(1, attempts + 1):
        try:
            status = post(endpoint["url"], content=body, headers=headers).status_code
            if status < 300:
                return f"Webhook {event} delivered to {endpoint['url']}"
            last = f"status {status}"
        except Exception as e:  # noqa: BLE001 - any failure to reach the receiver is retried
            last = f"{type(e).__name__}: {e}"
        if attempt < attempts:
            sleep(pause_s * 2 ** (attempt - 1))
    return f"Webhook {event} to {endpoint['url']} failed after {attempts} attempts: {last}"
