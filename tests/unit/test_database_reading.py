"""database.reading: the connection reads run on. On SQLite each thread keeps one, in
autocommit: it sees every commit made after its last statement (no snapshot held between
reads, so no stale page and no WAL checkpoint held back), it is this thread's alone, and
close_readers closes every thread's."""

from __future__ import annotations

import threading

from sqlalchemy import text

from flywheel import database
from flywheel.database import close_readers, open_engine, reading, writing


def _engine(tmp_path):
    engine = open_engine(f"sqlite:///{tmp_path / 'r.db'}")
    with writing(engine) as conn:
        conn.execute(text("CREATE TABLE t (x INTEGER)"))
    return engine


def test_a_kept_reader_sees_each_later_commit(tmp_path):
    engine = _engine(tmp_path)
    with reading(engine) as conn:
        assert conn.execute(text("SELECT count(*) FROM t")).scalar() == 0
        first = conn
    with writing(engine) as w:
        w.execute(text("INSERT INTO t VALUES (1)"))
    with reading(engine) as conn:
        assert conn is first  # kept, not checked out again
        assert conn.execute(text("SELECT count(*) FROM t")).scalar() == 1
        assert not conn.connection.dbapi_connection.in_transaction  # no BEGIN left open between reads
    close_readers(engine)
    engine.dispose()


def test_each_thread_has_its_own_and_close_readers_closes_them_all(tmp_path):
    engine = _engine(tmp_path)
    seen = []

    def read():
        with reading(engine) as conn:
            conn.execute(text("SELECT 1"))
            seen.append(conn)

    threads = [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    read()
    assert len({id(c) for c in seen}) == 4
    close_readers(engine)
    assert all(c.closed for c in seen) and id(engine) not in database._held
    with reading(engine) as conn:  # a read after close_readers opens another
        assert conn.execute(text("SELECT count(*) FROM t")).scalar() == 0 and conn is not seen[-1]
    close_readers(engine)
    engine.dispose()


def test_a_writer_still_takes_the_lock_beside_a_kept_reader(tmp_path):
    """The reader holds no transaction, so BEGIN IMMEDIATE does not wait on it."""
    engine = _engine(tmp_path)
    with reading(engine) as conn:
        conn.execute(text("SELECT count(*) FROM t")).scalar()
    with writing(engine) as w:
        w.execute(text("INSERT INTO t VALUES (2)"))
    with reading(engine) as conn:
        assert conn.execute(text("SELECT sum(x) FROM t")).scalar() == 2
    close_readers(engine)
    engine.dispose()
