"""Metric sinks with their real packages: a short SFT, DPO and RL run each logs to W&B (offline),
MLflow (a SQLite store in the run's folder) and TensorBoard (when installed), and what each
stored, read back with that package's own reader or schema, equals metrics.jsonl row for row.
A cycle's figures reach the same sinks; a fine-tuning job's `metrics` event for step N carries
metrics.jsonl's row N. W&B never tries the network here (WANDB_MODE=offline)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from flywheel.config import ConfigError, DPOConfig, RLConfig, SFTConfig, validate
from flywheel.models import TinySpec, build_tiny_model
from flywheel.train.metrics import MetricsWriter, read_metrics
from flywheel.train.sinks.mlflow_sink import metric_name


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    # imported here, not at collection: only the test worker that runs this file pays for them
    pytest.importorskip("wandb", reason="extra `wandb` (in `dev`)")
    pytest.importorskip("mlflow", reason="extra `mlflow` (in `dev`)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m"), TinySpec(hidden=32, layers=1, heads=2, ffn=64, seed=0))


def has_tensorboard() -> bool:
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        from tensorboard.backend.event_processing import event_accumulator  # noqa: F401
    except ImportError:
        return False
    return True


LOGGERS = ["jsonl", "wandb", "mlflow"] + (["tensorboard"] if has_tensorboard() else [])


# ---------------------------------------------------------------- readers, one per sink


def expected(out: Path) -> dict[int, dict[str, float]]:
    """metrics.jsonl as step -> {key: number}: a step's rows merged (train and eval rows share steps)."""
    rows: dict[int, dict[str, float]] = {}
    for r in read_metrics(out / "metrics.jsonl"):
        rows.setdefault(r["step"], {}).update(
            {k: float(v) for k, v in r.items() if k not in ("step", "time")
             and isinstance(v, (int, float)) and not isinstance(v, bool)})
    return rows


def wandb_records(path: Path):
    """The records of an offline run's `.wandb` file, decoded with wandb's own protobuf schema.
    The file is a LevelDB-style log: a 7-byte header (":W&B", magic, version), then 32 KiB
    blocks of chunks, each `crc32 (4) | length (2) | type (1: full, 2: first, 3: middle, 4: last)`."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:  # a block's tail too short for a chunk header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += room
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_run(out: Path) -> tuple[dict, dict[int, dict[str, float]]]:
    """(the run's config, step -> logged numbers) of the one offline run under out/wandb."""
    files = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    config, history = {}, {}
    for record in wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config = {u.key: json.loads(u.value_json) for u in record.run.config.update}
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history.setdefault(items["_step"], {}).update({k: v for k, v in items.items() if not k.startswith("_")})
    return config, history


def mlflow_run(uri: str, name: str):
    """(the run, step -> logged numbers) of the one run called `name` in experiment flywheel."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("flywheel").experiment_id])
    mine = [r for r in runs if r.info.run_name == name]
    assert len(mine) == 1, [r.info.run_name for r in runs]
    run = mine[0]
    history: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            history.setdefault(m.step, {})[key] = m.value
    return run, history


def tensorboard_history(out: Path) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    history: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            history.setdefault(event.step, {})[tag] = event.value
    return history


def same(got: dict[int, dict[str, float]], want: dict[int, dict[str, float]], rel: float = 0.0) -> None:
    assert sorted(got) == sorted(want)
    for step, row in want.items():
        assert set(got[step]) == set(row), step
        for k, v in row.items():
            assert math.isclose(got[step][k], v, rel_tol=rel) or (math.isnan(v) and math.isnan(got[step][k])), \
                (step, k, got[step][k], v)


def check_sinks(out: Path, steps_key: str, steps: int) -> None:
    want = expected(out)
    assert len(want) >= 2  # more than one step reached the sinks
    config, history = wandb_run(out)
    same(history, want)
    assert config["train"][steps_key] == steps and config["output_dir"] == str(out)  # the run's config, once
    run, history = mlflow_run(f"sqlite:///{out / 'mlflow.db'}", out.name)
    same(history, {s: {metric_name(k): v for k, v in row.items()} for s, row in want.items()})
    assert run.data.params[f"train.{steps_key}"] == str(steps) and run.info.status == "FINISHED"
    if "tensorboard" in LOGGERS:
        same(tensorboard_history(out), want, rel=1e-6)  # float32 on disk


# ---------------------------------------------------------------- the three recipes


def sft_run(model, tmp_path):
    from flywheel.train.sft import run_sft

    rows = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(5) for b in range(5)]
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = validate(dict(model=str(model), output_dir=str(tmp_path / "sft"),
                        data={"train": [str(data)], "val_fraction": 0.2}, eval={"every": 2},
                        train={"steps": 3, "batch_size": 4, "micro_batch_size": 4},
                        log={"progress": False, "loggers": LOGGERS}, threads=1), SFTConfig)
    run_sft(cfg, log=lambda m: None)
    return cfg


def dpo_run(model, tmp_path):
    from flywheel.train.dpo import run_dpo

    def pair(q, good, bad):
        return {"input": {"messages": [{"role": "user", "content": q}]},
                "preferred_output": [{"role": "assistant", "content": good}],
                "non_preferred_output": [{"role": "assistant", "content": bad}]}

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(pair(f"{a}+{a}?", str(2 * a), str(2 * a + 1))) + "\n" for a in range(6)))
    cfg = validate(dict(model=str(model), output_dir=str(tmp_path / "dpo"), data={"train": [str(data)]},
                        train={"steps": 3, "batch_size": 2}, log={"progress": False, "loggers": LOGGERS},
                        threads=1), DPOConfig)
    run_dpo(cfg, log=lambda m: None)
    return cfg


def rl_run(model, tmp_path):
    from flywheel.train.rl import run_rl

    cfg = validate(dict(model=str(model), output_dir=str(tmp_path / "rl"), env={"name": "arithmetic"},
                        train={"steps": 2, "groups_per_step": 2, "group_size": 2}, sampling={"max_tokens": 3},
                        eval={"tasks": 4, "pass_k": 2}, algo={"dynamic_sampling": False},
                        log={"progress": False, "loggers": LOGGERS}, threads=1), RLConfig)
    run_rl(cfg, log=lambda m: None)
    return cfg


@pytest.mark.parametrize("recipe", [
    pytest.param(sft_run, id="sft"),
    pytest.param(dpo_run, id="dpo", marks=pytest.mark.slow),  # ~10 s each with the sinks' start-up
    pytest.param(rl_run, id="rl", marks=pytest.mark.slow),
])
def test_each_sink_holds_the_jsonl_rows(model, tmp_path, recipe):
    cfg = recipe(model, tmp_path)
    check_sinks(Path(cfg.output_dir), "steps", 2 if recipe is rl_run else 3)


def test_metric_names_in_mlflows_alphabet():
    """RL's eval/pass@2 has a character MLflow refuses in a metric name: it arrives as eval/pass_at_2."""
    assert metric_name("eval/pass@2") == "eval/pass_at_2"
    assert metric_name("a:b c/d-e.f_g") == "a:b c/d-e.f_g" and metric_name("x%y") == "x_y"


# ---------------------------------------------------------------- resume, config errors, failures


def test_a_resumed_writer_logs_into_the_same_wandb_and_mlflow_runs(tmp_path):
    from flywheel.config import SinksConfig

    log = SinksConfig(loggers=["wandb", "mlflow"], run_name="r")
    first = MetricsWriter.for_run(tmp_path / "metrics.jsonl", log, config={"train": {"lr": 0.1}})
    first.log(1, loss=2.0)
    first.log(2, loss=1.5, note="words stay in the JSONL only")
    first.close()
    ids = json.loads((tmp_path / "metrics.sinks.json").read_text())
    second = MetricsWriter.for_run(tmp_path / "metrics.jsonl", log, start_step=2, config={"train": {"lr": 0.2}})
    second.log(3, loss=1.0)
    second.close()
    assert json.loads((tmp_path / "metrics.sinks.json").read_text()) == ids
    run, history = mlflow_run(f"sqlite:///{tmp_path / 'mlflow.db'}", "r")
    assert run.info.run_id == ids["mlflow"]["run_id"] and run.data.params["train.lr"] == "0.1"
    assert history == {1: {"loss": 2.0}, 2: {"loss": 1.5}, 3: {"loss": 1.0}}
    folders = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all(f.name.endswith(ids["wandb"]["id"]) for f in folders)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_a_bad_logger_name_and_the_old_flag_are_config_errors(model, tmp_path):
    base = dict(model=str(model), output_dir=str(tmp_path), data={"train": ["x.jsonl"]})
    with pytest.raises(ConfigError, match=r"log\.loggers\.1: Input should be 'jsonl', 'tensorboard', 'wandb' "
                                          r"or 'mlflow' \(got 'neptune'\)"):
        validate({**base, "log": {"loggers": ["jsonl", "neptune"]}}, SFTConfig)
    with pytest.raises(ConfigError, match=r"log\.tensorboard: replaced by log\.loggers: write "
                                          r"`loggers: \[jsonl, tensorboard\]`"):
        validate({**base, "log": {"tensorboard": True}}, SFTConfig)


def test_a_sink_that_fails_while_logging_is_dropped_and_jsonl_goes_on(tmp_path):
    class Broken:
        closed = False

        def log(self, step, scalars):
            raise OSError("disk full")

        def close(self):
            Broken.closed = True

    writer = MetricsWriter(tmp_path / "metrics.jsonl", sinks=[Broken()])
    with pytest.warns(UserWarning, match=r"Broken failed at step 1 and is dropped .*OSError: disk full"):
        writer.log(1, loss=1.0)
    writer.log(2, loss=0.5)
    writer.close()
    assert Broken.closed and [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1.0, 0.5]


# ---------------------------------------------------------------- a cycle's figures, a job's events


def test_a_cycles_figures_reach_the_loops_sinks(tmp_path):
    from flywheel.loop.cycle import CycleState
    from flywheel.loop.cycle_metrics import log_cycle
    from flywheel.loop.loop_config import LoopConfig, stage_config

    cfg = LoopConfig(data_dir=str(tmp_path), log={"loggers": ["mlflow"], "project": "flywheel"})
    for n, promote in ((1, False), (2, True)):
        st = CycleState(id=f"c{n}", stage="finished", started_at="", incumbent="v1", incumbent_path="m",
                        trace_cursor=0, since_cursor=0, new_failures=20, usd=0.5 * n, outcome="promoted",
                        stages_run=[{"stage": "sft", "examples": 8, "steps": 4, "seconds": 2.0, "final_model": "x"},
                                    {"stage": "rl", "skipped": "budget spent", "seconds": 0.0, "final_model": "x"}],
                        scores={"incumbent": {"new_failures": 0.25}, "candidate": {"new_failures": 0.25 + 0.1 * n}},
                        decision={"promote": promote, "gain": 0.1 * n, "deltas": {"new_failures": 0.1 * n}})
        log_cycle(cfg, st)
    rows = read_metrics(tmp_path / "cycle_metrics.jsonl")
    assert [(r["step"], r["cycle"], r["gate/promoted"]) for r in rows] == [(1, "c1", 0), (2, "c2", 1)]
    run, history = mlflow_run(f"sqlite:///{tmp_path / 'mlflow.db'}", f"loop-{tmp_path.name}")
    assert history[2]["score/candidate/new_failures"] == pytest.approx(0.45, abs=1e-12)
    assert history[1]["stage/sft/steps"] == 4.0 and history[1]["stage/rl/skipped"] == 1.0
    assert history[2]["gate/promoted"] == 1.0 and history[1]["usd"] == 0.5
    # a stage logs to the loop's sinks under its own log settings, as run c3-sft
    stage = stage_config(cfg, "sft", model="m", output_dir=str(tmp_path / "cycles" / "c3" / "sft"), resume=False,
                         data={"train": ["t.jsonl"]})
    assert stage.log.loggers == ["mlflow"] and stage.log.run_name == "c3-sft"
    assert LoopConfig(data_dir=str(tmp_path)).log is None  # no `log` section: no cycle figures


def test_a_jobs_metrics_event_for_step_n_carries_the_jsonl_row_n(model, tmp_path):
    from flywheel.jobs import JobStore
    from flywheel.jobs.store import data_file_url
    from flywheel.train.sft import run_sft
    from flywheel.worker.job_worker import JobProgress

    store = JobStore(data_file_url(tmp_path), tmp_path / "files")
    try:
        job = store.create_job("t", model="tiny", method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1}}}, training_file="file-x",
                               validation_file=None, suffix=None, seed=0, meta=None)
        job_dir = tmp_path / "work" / job["id"]
        rows = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(4) for b in range(4)]
        data = tmp_path / "d.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        cfg = validate(dict(model=str(model), output_dir=str(job_dir / "train"), data={"train": [str(data)]},
                            train={"steps": 3, "batch_size": 4, "micro_batch_size": 4}, log={"progress": False},
                            threads=1), SFTConfig)
        progress = JobProgress(store, store.get_job(None, job["id"]), job_dir, total_steps=3, every=1)
        progress.begin()
        run_sft(cfg, log=lambda m: None)
        progress.publish()
        events = [e for e in store.list_events("t", job["id"], limit=100)[0] if e["type"] == "metrics"]
    finally:
        store.close()
    by_step = {e["data"]["step"]: e["data"]["metrics"] for e in events}
    want = {r["step"]: {k: v for k, v in r.items() if k not in ("step", "time")}
            for r in read_metrics(job_dir / "train" / "metrics.jsonl") if "loss" in r}
    assert sorted(by_step) == [1, 2, 3] and by_step == want
