"""A rollout worker process refills a work item itself (rollout/refill.py): an untrained
model answers no arithmetic, so every group is flat and every spare is played, in order."""

import time

from flywheel.envs import load_env
from flywheel.models import TinySpec, build_tiny_model, load
from flywheel.orchestrate import ProcessRollouts, WorkerSpec, WorkItem
from flywheel.orchestrate.pool import rollout_transport
from flywheel.rollout.refill import varied_rewards


def test_a_worker_plays_spares_in_place_of_flat_groups(tmp_path):
    model_dir = build_tiny_model(tmp_path, TinySpec(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, seed=3))
    model, _ = load(model_dir)
    transport = rollout_transport(model, 1)
    spec = WorkerSpec(model=str(model_dir), env_name="arithmetic", env_settings={}, transport_name=transport.name,
                      sampling={"max_tokens": 3, "temperature": 1.0}, group_size=2, threads=1)
    tasks = load_env("arithmetic").tasks("test", n=5)
    pool = ProcessRollouts(spec, 1, max_restarts=0, log=lambda m: None)
    try:
        pool.publish(dict(model.named_parameters()), 0)
        pool.submit(WorkItem(0, tasks[:2], 0, spares=tasks[2:], keep=varied_rewards))
        pool.submit(WorkItem(1, tasks[:2], 0, spares=tasks[2:]))  # no keep rule: spares unplayed
        results = {}
        deadline = time.monotonic() + 120
        while len(results) < 2 and time.monotonic() < deadline:
            results.update({r.item_id: r for r in pool.poll(0.2)})
        refilled, plain = results[0], results[1]
        assert all(not varied_rewards(g) for g in refilled.groups)  # untrained: every reward 0
        assert [g.task_id for g in refilled.groups] == [t.id for t in tasks]
        assert [g.task_id for g in plain.groups] == [t.id for t in tasks[:2]]
    finally:
        pool.close()
        transport.close()
