"""Rollout workers pick weights up zero-copy through a reader slot of the run's segment: they
sample with exactly the published weights, release their lease when they exit, and a worker
killed holding one neither blocks the learner nor keeps its replacement from a slot."""

import os
import signal
import time

import pytest
import torch

from flywheel.envs import load_env
from flywheel.inference import LocalEngine
from flywheel.models import TinySpec, build_tiny_model, load
from flywheel.orchestrate import ProcessRollouts, WorkerSpec, WorkItem
from flywheel.orchestrate.pool import rollout_transport


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("worker-pickup"),
                            TinySpec(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, seed=11))


def _spec(model_dir, transport, packed=None) -> WorkerSpec:
    return WorkerSpec(model=str(model_dir), env_name="arithmetic", env_settings={}, transport_name=transport.name,
                      sampling={"max_tokens": 4, "temperature": 1.0}, group_size=2, threads=1, packed=packed)


def _weights(learner, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for k, p in learner.named_parameters()}


def _result(pool, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        results = pool.poll(0.2)
        if results:
            (r,) = results
            return r
    raise AssertionError("no result from the rollout worker")


# one worker process per layout; make test keeps the packed one (unit/test_weight_pickup.py checks
# both layouts' zero-copy pickup in process)
@pytest.mark.parametrize("packed", [pytest.param(False, marks=pytest.mark.slow), True], ids=["dense", "packed"])
def test_a_worker_samples_with_exactly_the_weights_it_picked_up(model_dir, packed):
    learner, _ = load(model_dir)
    transport = rollout_transport(learner, 1)
    reference = LocalEngine.from_path(str(model_dir), packed=packed)  # weights by update_weights
    tasks = load_env("arithmetic").tasks("test", n=3)
    pool = ProcessRollouts(_spec(model_dir, transport, packed), 1, max_restarts=0, log=lambda m: None)
    try:
        for v in range(3):
            w = _weights(learner, v)
            pool.publish(w, v)
            pool.submit(WorkItem(v, [tasks[v]], min_version=v))
            r = _result(pool)
            assert r.version == v and r.weight_pickup == "bind" and 0 < r.kernel_rebuild_s < r.weight_load_s
            reference.update_weights(w, v)
            for t in r.groups[0].trajectories:
                sampled = torch.tensor(t.loss_mask[1:]).bool()
                assert sampled.any() and set(t.versions[i] for i, m in enumerate(t.loss_mask) if m) == {v}
                with torch.no_grad():
                    lp = reference.model(torch.tensor([t.ids])).logits[0, :-1].log_softmax(-1)
                ref = lp.gather(-1, torch.tensor(t.ids[1:])[:, None])[:, 0]
                got = torch.tensor(t.behavior_logprobs[1:])
                assert torch.allclose(ref[sampled], got[sampled], atol=1e-4)
        (slot_pid,) = [int(transport.header[transport._lease(0) + 1])]
        assert slot_pid == pool.pids()[0] and list(transport.leases()) == [0]
    finally:
        pool.close()
        assert transport.leases() == {} and transport.header[transport._lease(0) + 1] == 0  # released, freed
        transport.close()


@pytest.mark.slow  # processes killed and restarted, or the whole flow end to end: make test-all
def test_a_killed_workers_lease_blocks_nothing_and_its_replacement_gets_a_slot(model_dir):
    learner, _ = load(model_dir)
    transport = rollout_transport(learner, 1)  # 1 slot, 3 buffers
    tasks = load_env("arithmetic").tasks("test", n=4)
    pool = ProcessRollouts(_spec(model_dir, transport), 1, max_restarts=1, log=lambda m: None)
    try:
        pool.publish(_weights(learner, 0), 0)
        pool.submit(WorkItem(0, [tasks[0]], min_version=0))
        assert _result(pool).weight_pickup == "bind"
        (dead,) = pool.pids()
        leased = transport.leases()[0]
        os.kill(dead, signal.SIGKILL)
        pool.workers[0].process.wait(timeout=30)
        for v in range(1, 6):  # the dead worker's lease pins one buffer; the writer never waits
            pool.publish(_weights(learner, v), v)
            assert transport.version() == v
        assert transport.leases() == {0: leased}  # not reclaimed yet: nobody was short of a buffer
        pool.submit(WorkItem(1, [tasks[1]], min_version=5))
        r = _result(pool)  # the pool restarts the worker; its replacement claims the slot
        assert pool.restarts == 1 and r.version == 5 and r.weight_pickup == "bind"
        assert int(transport.header[transport._lease(0) + 1]) == pool.pids()[0] != dead
    finally:
        pool.close()
        assert transport.leases() == {}
        transport.close()
