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


import pytest  # noqa: E402


def pytest_generate_tests(metafunc) -> None:
    """A test of a store's `db_url` runs on SQLite, and on PostgreSQL too when pytest_configure started one
    (collection comes after it; a fixture's params would be read at import, before)."""
    if "db_url" in metafunc.fixturenames:
        databases = ["sqlite"] + (["postgresql"] if os.environ.get("FLYWHEEL_TEST_POSTGRES_URL") else [])
        metafunc.parametrize("db_url", databases, indirect=True)


@pytest.fixture
def db_url(request, tmp_path):
    """A store's database URL: SQLite in tmp_path, or PostgreSQL (emptied first)."""
    from flywheel.jobs.store import data_file_url

    if request.param == "sqlite":
        return data_file_url(tmp_path)
    from postgres_server import reset

    return reset(os.environ["FLYWHEEL_TEST_POSTGRES_URL"])


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for the module's servers and workers: the machine is shared, the tiny model needs no more."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
