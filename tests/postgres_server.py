"""A throwaway PostgreSQL server for the test session (Debian's postgresql package): a cluster
initialised in a temporary folder, listening only on a Unix socket there, owned by the
`postgres` user when the tests run as root (initdb refuses root). `start()` returns a
SQLAlchemy URL of an empty database; `stop()` stops the server and removes the folder."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def binaries() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(found[-1]).parent if found else None


class PostgresServer:
    def __init__(self):
        self.bin = binaries()
        if self.bin is None:
            raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql)")
        self.root = Path(tempfile.mkdtemp(prefix="flywheel-pg-"))
        self.data = self.root / "data"
        self.user = "postgres" if os.geteuid() == 0 else None

    def _run(self, *argv: str) -> None:
        cmd = [str(self.bin / argv[0]), *argv[1:]]
        if self.user:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip() or done.stdout.strip()}")

    def start(self) -> str:
        if self.user:
            shutil.chown(self.root, self.user)
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "flywheel", "--no-sync")
        opts = f"-c listen_addresses='' -c unix_socket_directories={self.root} -c fsync=off -c max_connections=200"
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-w", "-l", str(self.root / "log"), "start")
        self._run("createdb", "-h", str(self.root), "-U", "flywheel", "flywheel_test")
        return f"postgresql+psycopg://flywheel@/flywheel_test?host={self.root}"

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def reset(url: str) -> str:
    """Empty the database at `url` (every table, the migrations' version tables too); returns url."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("DROP SCHEMA public CASCADE"))
        conn.execute(text("CREATE SCHEMA public"))
    engine.dispose()
    return url
