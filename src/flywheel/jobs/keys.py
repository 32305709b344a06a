"""API keys of the service's tenants, hashed at rest.

A key is `fw-` + 32 random bytes (URL-safe base64), shown once when made. The database keeps its
SHA-256 (a key has 256 bits of entropy, so a fast hash cannot be searched; a slow one would only
slow every request) and its first 8 characters, to tell keys apart in listings. `tenant_of`
maps a presented key to its tenant, or None for an unknown or revoked one, comparing hashes
through the unique index, never the keys themselves.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from sqlalchemy import func, insert, select, update

from flywheel.clock import utc_naive, utc_now
from flywheel.database import writing
from flywheel.jobs.store import NotFound, new_id
from flywheel.jobs.tables import PREFIX_CHARS, KeyRow


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class Keys:
    """The keys table of a JobStore's database (`Keys(store.engine)`)."""

    def __init__(self, engine):
        self.engine = engine

    def create(self, tenant: str, name: str | None = None) -> tuple[str, dict[str, Any]]:
        """(the key, shown only now; its row without the hash)."""
        if not tenant or len(tenant) > 200 or not all(c.isalnum() or c in "-_." for c in tenant):
            raise ValueError(f"a tenant is 1-200 letters, digits, '-', '_' or '.', got {tenant!r}")
        key = "fw-" + secrets.token_urlsafe(32)
        row = dict(id=new_id("key"), tenant=tenant, sha256=key_hash(key), prefix=key[:PREFIX_CHARS], name=name,
                   created_at=utc_naive(utc_now()), revoked_at=None)
        with writing(self.engine) as conn:
            conn.execute(insert(KeyRow).values(**row))
        return key, {k: v for k, v in row.items() if k != "sha256"}

    def list(self, tenant: str | None = None) -> list[dict[str, Any]]:
        q = select(KeyRow.id, KeyRow.tenant, KeyRow.prefix, KeyRow.name, KeyRow.created_at, KeyRow.revoked_at)
        if tenant is not None:
            q = q.where(KeyRow.tenant == tenant)
        with self.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(q.order_by(KeyRow.created_at))]

    def revoke(self, key_id: str) -> None:
        with writing(self.engine) as conn:
            done = conn.execute(update(KeyRow).where(KeyRow.id == key_id, KeyRow.revoked_at.is_(None))
                                .values(revoked_at=utc_naive(utc_now())))
            if done.rowcount != 1:
                raise NotFound(f"no active key {key_id!r}", "key_id")

    def tenant_of(self, key: str) -> str | None:
        with self.engine.connect() as conn:
            return conn.scalar(select(KeyRow.tenant).where(KeyRow.sha256 == key_hash(key),
                                                           KeyRow.revoked_at.is_(None)))

    def any(self) -> bool:
        """Whether any key was ever made: then every request needs one."""
        with self.engine.connect() as conn:
            return bool(conn.scalar(select(func.count()).select_from(KeyRow)))
