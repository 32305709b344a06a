"""JobStore: files, the job lifecycle, claims with leases, tenancy and paging, on SQLite and,
when FLYWHEEL_TEST_POSTGRES_URL names a database (make test-all starts one), on PostgreSQL."""

from __future__ import annotations

import io
import threading
import time

import pytest


from flywheel.jobs import Conflict, JobStore, LeaseLost, NotFound

METHOD = {"type": "supervised", "supervised": {"hyperparameters": {}}}


@pytest.fixture
def url(db_url):
    return db_url  # tests/conftest.py: SQLite, and PostgreSQL when configured


@pytest.fixture
def store(url, tmp_path):
    s = JobStore(url, tmp_path / "files")
    yield s
    s.close()


def add_file(store, tenant: str, filename: str, content: bytes) -> dict:
    staged = store.stage(io.BytesIO(content), filename, "fine-tune", max_bytes=2 ** 20, max_line_bytes=2 ** 10)
    return store.add_file(tenant, filename, "fine-tune", staged)


def job(store, tenant="a", file_id=None):
    file_id = file_id or add_file(store, tenant, "t.jsonl", b"{}\n")["id"]
    j = store.create_job(tenant, model="tiny", method=METHOD, training_file=file_id, validation_file=None,
                         suffix=None, seed=0, meta=None)
    store.set_validated(j["id"], error=None, hyperparameters={}, method=METHOD)
    return j["id"]


def test_files_round_trip_and_belong_to_their_tenant(store):
    f = add_file(store, "a", "train.jsonl", b'{"x": 1}\n')
    assert store.file_path("a", f["id"]).read_bytes() == b'{"x": 1}\n'
    with pytest.raises(NotFound):
        store.get_file("b", f["id"])
    with pytest.raises(NotFound):
        store.delete_file("b", f["id"])
    assert store.list_files("b")[0] == []
    store.delete_file("a", f["id"])
    assert not (store.files_dir / f["id"]).exists() and store.list_files("a")[0] == []


def test_a_file_in_use_by_an_unfinished_job_is_not_deleted(store):
    jid = job(store)
    file_id = store.get_job("a", jid)["training_file"]
    with pytest.raises(Conflict, match=jid):
        store.delete_file("a", file_id)
    store.cancel("a", jid)
    store.delete_file("a", file_id)


def test_pages_newest_first_with_after_cursor(store):
    ids = [job(store) for _ in range(5)]
    page, more = store.list_jobs("a", limit=2)
    assert [j["id"] for j in page] == [ids[4], ids[3]] and more
    page2, more2 = store.list_jobs("a", after=page[-1]["id"], limit=10)
    assert [j["id"] for j in page2] == [ids[2], ids[1], ids[0]] and not more2
    with pytest.raises(NotFound):
        store.list_jobs("b", after=ids[0])  # another tenant's id is no cursor


def test_validation_failure_fails_the_job_with_the_error(store):
    f = add_file(store, "a", "t.jsonl", b'{"x": 1}\n')
    j = store.create_job("a", model="tiny", method=METHOD, training_file=f["id"], validation_file=None, suffix=None,
                         seed=0, meta=None)
    assert j["status"] == "validating_files"
    error = {"code": "invalid_training_file", "message": "line 1: not valid JSON", "param": "training_file"}
    store.set_validated(j["id"], error=error, hyperparameters=None)
    j = store.get_job("a", j["id"])
    assert j["status"] == "failed" and j["error"] == error and j["finished_at"] is not None
    assert store.claim("w", 60) is None


def test_claim_heartbeat_finish(store):
    jid = job(store)
    claimed = store.claim("w1", 60)
    assert claimed["id"] == jid and claimed["status"] == "running" and claimed["attempts"] == 1
    assert store.claim("w2", 60) is None  # held
    assert store.heartbeat(jid, "w1", 60) is None
    with pytest.raises(LeaseLost):
        store.heartbeat(jid, "w2", 60)
    store.finish(jid, "w1", "succeeded", "done", fine_tuned_model="ft:tiny:a::x", trained_tokens=10)
    j = store.get_job("a", jid)
    assert (j["status"], j["worker"], j["trained_tokens"]) == ("succeeded", None, 10)
    with pytest.raises(LeaseLost):
        store.finish(jid, "w1", "failed", "again")
    messages = [e["message"] for e in store.list_events("a", jid, limit=50)[0]]
    assert messages[0] == "done" and messages[-1].startswith("Validating training file")


def test_an_expired_lease_is_claimed_again_then_fails_after_max_attempts(url, tmp_path):
    store = JobStore(url, tmp_path / "files", max_attempts=2)
    jid = job(store)
    assert store.claim("w1", 0.05)["attempts"] == 1
    time.sleep(0.1)
    again = store.claim("w2", 0.05)
    assert again["id"] == jid and again["worker"] == "w2" and again["attempts"] == 2
    with pytest.raises(LeaseLost):
        store.heartbeat(jid, "w1", 60)  # the first worker lost it
    time.sleep(0.1)
    assert store.claim("w3", 60) is None
    j = store.get_job("a", jid)
    assert j["status"] == "failed" and j["error"]["code"] == "worker_lost"
    store.close()


def test_cancel_and_pause_reach_a_running_job_through_its_heartbeat(store):
    jid = job(store)
    store.claim("w", 60)
    assert store.pause("a", jid)["status"] == "running"
    assert store.heartbeat(jid, "w", 60) == "pause"
    store.finish(jid, "w", "paused", "paused at step 3")
    with pytest.raises(Conflict):
        store.pause("a", jid)
    assert store.resume("a", jid)["status"] == "queued"
    store.claim("w", 60)
    store.cancel("a", jid)
    assert store.heartbeat(jid, "w", 60) == "cancel"
    store.finish(jid, "w", "cancelled", "cancelled at step 5")
    with pytest.raises(Conflict, match="already cancelled"):
        store.cancel("a", jid)


def test_a_queued_job_cancels_and_pauses_at_once(store):
    jid, other = job(store), job(store)
    assert store.cancel("a", jid)["status"] == "cancelled"
    assert store.pause("a", other)["status"] == "paused"
    assert store.claim("w", 60) is None
    with pytest.raises(NotFound):
        store.cancel("b", other)


def test_concurrent_claimers_never_share_a_job(store):
    ids = {job(store) for _ in range(12)}
    got: list[str] = []
    lock = threading.Lock()

    def worker(name):
        while (j := store.claim(name, 60)) is not None:
            with lock:
                got.append(j["id"])

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == sorted(ids)


def test_a_tenant_at_its_running_limit_waits_while_others_are_claimed(store):
    a1, a2 = job(store, "a"), job(store, "a")
    b1 = job(store, "b")
    assert store.claim("w1", 60, max_running=1)["id"] == a1
    assert store.claim("w2", 60, max_running=1)["id"] == b1  # a2 is older but its tenant is at its limit
    assert store.claim("w3", 60, max_running=1) is None
    store.finish(a1, "w1", "succeeded", "done")
    assert store.claim("w3", 60, max_running=1)["id"] == a2
    assert store.unfinished("a") == 1 and store.unfinished("b") == 1
