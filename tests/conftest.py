"""Session-wide services: with FLYWHEEL_TEST_POSTGRES=1 (what `make test-all` sets) and no
FLYWHEEL_TEST_POSTGRES_URL, a PostgreSQL server is started for the session, so the tests that
take a database URL run against it as well as against SQLite (tests/postgres_server.py)."""

from __future__ import annotations

import os

_server = None


def pytest_configure(config) -> None:
    global _server
    if os.environ.get("FLYWHEEL_TEST_POSTGRES") == "1" and not os.environ.get("FLYWHEEL_TEST_POSTGRES_URL"):
        from postgres_server import PostgresServer

        _server = PostgresServer()
        os.environ["FLYWHEEL_TEST_POSTGRES_URL"] = _server.start()


def pytest_unconfigure(config) -> None:
    if _server is not None:
        _server.stop()
