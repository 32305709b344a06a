"""`flywheel worker`: a process that takes fine-tuning jobs from the queue and trains them.

A worker claims one job at a time (JobStore.claim: a lease it renews every `heartbeat_s`),
writes the job's flywheel run config (`run_spec`; an environment job's replay files beside
it) into work_dir/<job id>/run.json and
trains it in a child process (worker/job_run.py), forked from the worker's pre-imported
zygote (worker/zygote.py) and dying with the worker. While the
child runs, the worker
- renews the lease and reads what the client asked: `cancel` or `pause` sends the child
  SIGTERM, which checkpoints after its step; the job ends `cancelled`, or `paused` (a later
  `resume` queues it and training continues from that checkpoint);
- turns the run's metrics.jsonl into `metrics` events every `metrics_every` steps and each
  new training checkpoint into a job checkpoint (a model folder hard-linked from it, usable
  as a model at once).
A job whose worker died (SIGKILL, a lost machine) is claimed again by another worker once its
lease runs out and resumes from the newest checkpoint in the same output folder (work_dir is
shared by the workers of a store). A worker asked to stop (SIGTERM) stops its child at a
checkpoint and puts the job back in the queue. Each attempt's time is recorded in the cost
ledger (work_dir/ledger.jsonl, run = job id), and the job's `estimated_cost` is their sum.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

from flywheel.economics.ledger import Ledger
from flywheel.jobs import JobStore, LeaseLost
from flywheel.jobs.hyperparameters import BASE_LR, LORA_LR_FACTOR, micro_batch
from flywheel.jobs.flywheels import CYCLE_METHOD, Flywheels, production_update
from flywheel.jobs.objects import fine_tuned_model_name
from flywheel.clock import utc_naive, utc_now
from flywheel.jobs.store import worker_name
from flywheel.finetuning.managed_config import GRADED_ENV
from flywheel.jobs.webhooks import Webhooks, deliver
from flywheel.finetuning.fine_tuning import ENV_GRADER, FineTuning
from flywheel.worker.zygote import Zygote

STAGES = {"supervised": "sft", "dpo": "dpo", "reinforcement": "rl"}
MAX_FAILED_CYCLES = 3  # a managed flywheel whose cycles fail this many times in a row is paused
RL_GROUP = 4  # samples per prompt of a reinforcement job, times its compute_multiplier (at least 2)
RL_MAX_TOKENS = 128  # new tokens per sampled answer


def run_spec(job: dict[str, Any], model: str, train_file: str, val_file: str | None, n_rows: int, out: str,
             *, threads: int | None = None, base_lr: dict[str, float] | None = None,
             grader_models: dict[str, str] | None = None) -> dict[str, Any]:
    """The flywheel run (`{"kind", "config"}`) that trains `job` (a JobRow dict with its method
    resolved): one checkpoint per epoch, validated per epoch when there is a validation file;
    a reinforcement job is GRPO on the graded environment (envs/graded.py), `batch_size`
    prompts a step, evaluated every `eval_interval` steps on the validation rows (else on a
    hash-split fifth of the training rows)."""
    kind = job["method"]["type"]
    if kind not in STAGES:
        raise ValueError(f"{kind} jobs are not run by this worker")
    hp = job["method"][kind]["hyperparameters"]
    lora = hp.get("lora", "full")  # jobs resolved before LoRA existed trained every weight
    lr = (base_lr or BASE_LR)[kind] * hp["learning_rate_multiplier"] * (1.0 if lora == "full" else LORA_LR_FACTOR)
    per_epoch = max(1, math.ceil(n_rows / hp["batch_size"]))
    common = {"model": model, "output_dir": out, "resume": True, "threads": threads, "log": {"progress": False},
              "checkpoint": {"every": per_epoch, "keep": 2},
              "eval": {"every": per_epoch if val_file else 0}}
    if kind == "reinforcement":
        steps = max(1, math.ceil(hp["n_epochs"] * n_rows / hp["batch_size"]))
        grader = job["method"][kind]["grader"]
        if grader.get("type") == ENV_GRADER:
            train, test = replay_files(grader, train_file, val_file, Path(out).parent)
            env = {"name": "replay", "settings": {"train": train, "test": test}}
        else:
            env = {"name": GRADED_ENV, "settings": {"train": train_file, "test": val_file, "grader": grader,
                                                    "models": grader_models or None}}
        config = {**common, "checkpoint": {"every": per_epoch, "keep": 2}, "env": env,
                  "train": {"steps": steps, "groups_per_step": hp["batch_size"], "seed": job["seed"],
                            "group_size": max(2, round(RL_GROUP * hp["compute_multiplier"])),
                            "lora": None if lora == "full" else lora},
                  "sampling": {"temperature": 1.0, "max_tokens": RL_MAX_TOKENS},
                  "eval": {"every": hp["eval_interval"], "tasks": 200}, "optim": {"lr": lr}}
    elif kind == "supervised":
        config = {**common, "data": {"train": [train_file], "val": [val_file] if val_file else [], "format": "chat"},
                  "train": {"epochs": hp["n_epochs"], "batch_size": hp["batch_size"],
                            "micro_batch_size": micro_batch(hp["batch_size"]), "seed": job["seed"],
                            "lora": None if lora == "full" else lora},
                  "optim": {"lr": lr}}
    else:
        config = {**common, "data": {"train": [train_file], "val": [val_file] if val_file else []},
                  "train": {"epochs": hp["n_epochs"], "batch_size": hp["batch_size"], "seed": job["seed"],
                            "lora": None if lora == "full" else lora},
                  "beta": hp["beta"], "optim": {"lr": lr}}
    return {"kind": STAGES[kind], "config": config}


def replay_files(grader: dict[str, Any], train_file: str, val_file: str | None, job_dir: Path) -> tuple[str, str]:
    """The rows of an environment job as replay records (envs/replay.py) of its environment:
    job_dir/replay_{train,test}.jsonl. Without a validation file a hash of each task's prompt
    holds out a fifth (envs/splits.py)."""
    from flywheel.canonical import canonical
    from flywheel.envs.splits import side_of

    def records(path: str) -> list[dict[str, Any]]:
        rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        return [{"env": grader["env"], "settings": grader.get("settings", {}),
                 "task": {"id": f"row-{i}", **row["task"]}} for i, row in enumerate(rows)]

    train = records(train_file)
    if val_file is not None:
        test = records(val_file)
    else:
        sides = [side_of("job-task:" + canonical(r["task"]["prompt"])) for r in train]
        test = [r for r, side in zip(train, sides) if side == "test"]
        train = [r for r, side in zip(train, sides) if side == "train"]
        if not test and len(train) > 1:  # a small file the hash put wholly on one side: hold one out
            test = [train.pop()]
    paths = []
    for name, rows in (("replay_train.jsonl", train), ("replay_test.jsonl", test)):
        (job_dir / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        paths.append(str(job_dir / name))
    return paths[0], paths[1]


class JobWorker:
    def __init__(self, store: JobStore, base_models: dict[str, str | Path], work_dir: str | Path, *,
                 name: str | None = None, lease_s: float = 30.0, heartbeat_s: float = 1.0, metrics_every: int = 10,
                 hardware: str = "cpu-2core", threads: int | None = None, max_running: int | None = None,
                 log: Callable[[str], None] = print):
        """max_running: jobs of one tenant held by live workers at once (TenantLimits.max_running);
        the worker skips a tenant's further jobs until one ends."""
        self.store = store
        self.models = FineTuning(store, base_models)
        self.work_dir = Path(work_dir)
        self.name = name or worker_name()
        self.lease_s, self.heartbeat_s, self.metrics_every = lease_s, heartbeat_s, metrics_every
        self.hardware, self.threads, self.max_running, self.log = hardware, threads, max_running, log
        self.ledger = Ledger(self.work_dir / "ledger.jsonl")
        self.stopping = threading.Event()
        self.zygote = Zygote()  # forks each job's training process, imports done once

    def run(self, idle_s: float = 1.0, max_jobs: int | None = None) -> int:
        """Take jobs until `stopping` is set (or `max_jobs` ran); returns how many ran."""
        ran = 0
        try:
            while not self.stopping.is_set() and (max_jobs is None or ran < max_jobs):
                if self.run_one() is None:
                    self.stopping.wait(idle_s)
                else:
                    ran += 1
        finally:
            self.zygote.close()
        return ran

    def run_one(self) -> str | None:
        """Claim and train one job; its id, or None when the queue was empty."""
        job = self.store.claim(self.name, self.lease_s, self.max_running)
        if job is None:
            return None
        self.log(f"{job['id']}: claimed (attempt {job['attempts']})")
        try:
            self._train(job)
        except LeaseLost as exc:
            self.log(f"{job['id']}: {exc}; another worker has it")
        except Exception as exc:  # a defect here must not leave the job running forever
            self.log(f"{job['id']}: failed: {type(exc).__name__}: {exc}")
            self._finish(job, "failed", f"Fine-tuning job failed: {exc}",
                         error={"code": "worker_error", "message": f"{type(exc).__name__}: {exc}", "param": None})
        return job["id"]

    # ------------------------------------------------------------------ one job

    def _train(self, job: dict[str, Any]) -> None:
        if job["method"]["type"] == CYCLE_METHOD:
            return self._cycle(job)
        job_dir = self.work_dir / job["id"]
        job_dir.mkdir(parents=True, exist_ok=True)
        tenant = job["tenant"]
        train_file = self.store.file_path(tenant, job["training_file"])
        val_file = self.store.file_path(tenant, job["validation_file"]) if job["validation_file"] else None
        n_rows = self.store.get_file(tenant, job["training_file"])["lines"]
        grader = job["method"].get("reinforcement", {}).get("grader")
        spec = run_spec(job, str(self.models.model_path(tenant, job["model"])), str(train_file),
                        str(val_file) if val_file else None, n_rows, str(job_dir / "train"), threads=self.threads,
                        grader_models=self.models.grader_models(tenant, grader) if grader else None)
        (job_dir / "run.json").write_text(json.dumps(spec, indent=1), encoding="utf-8")
        (job_dir / "result.json").unlink(missing_ok=True)
        hp = job["method"][job["method"]["type"]]["hyperparameters"]
        progress = JobProgress(self.store, job, job_dir, math.ceil(hp["n_epochs"] * n_rows / hp["batch_size"]),
                             self.metrics_every)
        progress.begin()
        t0 = time.perf_counter()
        returncode, asked = self._run_child(job, job_dir, progress.publish)
        seconds = time.perf_counter() - t0
        result = _read_result(job_dir)
        self._record_cost(job, seconds, progress)
        step = progress.last_step
        if asked == "cancel":
            self._finish(job, "cancelled", f"Fine-tuning job cancelled at step {step}")
        elif asked == "pause":
            self._finish(job, "paused", f"Fine-tuning job paused at step {step}; resume continues from its checkpoint")
        elif asked == "release":
            self.store.release(job["id"], self.name, f"Worker {self.name} stopped; the job is queued again and "
                                                     f"resumes from step {step}")
        elif returncode != 0 or not result.get("final_model"):
            message = result.get("error") or f"the training process exited with status {returncode} " \
                                             f"(log: {job_dir / 'train.log'})"
            self._finish(job, "failed", f"Fine-tuning job failed: {message}",
                         error={"code": "training_failed", "message": message, "param": None})
        else:
            name = fine_tuned_model_name(job["model"], job["tenant"], job["suffix"], job["id"])
            self._finish(job, "succeeded", f"The job has successfully completed: {name}", fine_tuned_model=name,
                         model_path=result["final_model"])

    def _run_child(self, job: dict[str, Any], job_dir: Path, publish: Callable[[], None]) -> tuple[int, str | None]:
        """Run job_dir's run.json in a child process while holding the job's lease; returns
        (its exit status, what was asked of it: "cancel" | "pause" | "release" | None)."""
        child = self.zygote.spawn(job_dir)
        asked = None
        try:
            while child.poll() is None:
                try:
                    child.wait(self.heartbeat_s)
                except subprocess.TimeoutExpired:
                    pass
                control = self.store.heartbeat(job["id"], self.name, self.lease_s)
                if asked is None and (control in ("cancel", "pause") or self.stopping.is_set()):
                    asked = control or "release"
                    child.send_signal(signal.SIGTERM)
                publish()
        except BaseException:
            child.kill()
            child.wait()
            raise
        publish()
        return child.returncode, asked

    def _cycle(self, job: dict[str, Any]) -> None:
        """A managed flywheel's cycle (finetuning/managed_flywheels.py): curate its tenant's traces, train,
        gate and promote in the flywheel's own registry, in a child process; each stage reached
        becomes an event, the gate's decision and cost land on the cycle's row, and a promotion
        names the job's model and points the flywheel's production alias at it."""
        from flywheel.loop.cycle import LoopStores, abandon_cycle
        from flywheel.finetuning.managed_config import managed_config
        from flywheel.jobs.flywheel_request import FlywheelSpec
        from flywheel.traces.scope import TraceScope

        flywheels = Flywheels(self.store.engine)
        cycle = flywheels.cycle_of_job(job["id"])
        fw = flywheels.get(None, cycle["flywheel_id"])
        job_dir = self.work_dir / job["id"]
        job_dir.mkdir(parents=True, exist_ok=True)
        fw_spec = FlywheelSpec.model_validate(fw["spec"])
        cfg = managed_config(fw_spec, data_dir=fw["data_dir"], traces_url=fw["traces_url"], hardware=self.hardware)
        scope = TraceScope(fw["tenant"], tuple(dict.fromkeys([fw["alias"], *fw_spec.traces.models])))
        spec = {"kind": "cycle", "config": cfg.model_dump(mode="json"), "scope": scope.to_dict(), "job_id": job["id"]}
        (job_dir / "run.json").write_text(json.dumps(spec, indent=1), encoding="utf-8")
        (job_dir / "result.json").unlink(missing_ok=True)
        stages = _CycleStages(self.store, job["id"], cfg.root / "cycles")
        returncode, asked = self._run_child(job, job_dir, stages.publish)
        result = _read_result(job_dir)
        st = result.get("cycle")

        def abandon(outcome: str, reason: str) -> None:
            with LoopStores(cfg, scope) as stores:
                left = abandon_cycle(stores, outcome, reason)
            flywheels.record_cycle(cycle["id"], outcome=outcome, finished_at=utc_naive(utc_now()),
                                   decision=left.decision if left else {"promote": False, "reasons": [reason]})

        if st is not None and st["stage"] == "finished" and returncode == 0:
            self._cycle_decided(job, cycle, fw, st, result, flywheels)  # done before the ask arrived: it stands
        elif asked == "cancel":
            abandon("cancelled", "the cycle's job was cancelled")
            self._finish(job, "cancelled", f"Flywheel cycle {cycle['number']} cancelled")
        elif asked == "pause":
            self._finish(job, "paused", f"Flywheel cycle {cycle['number']} paused; resume continues it")
        elif asked == "release":
            self.store.release(job["id"], self.name, f"Worker {self.name} stopped; the cycle is queued again")
        else:
            message = result.get("error") or f"the cycle's process exited with status {returncode} " \
                                             f"(log: {job_dir / 'train.log'})"
            abandon("failed", message)
            self._finish(job, "failed", f"Flywheel cycle failed: {message}",
                         error={"code": "cycle_failed", "message": message, "param": None})
            if flywheels.failed_in_a_row(fw["id"]) >= MAX_FAILED_CYCLES:
                flywheels.set_status(fw["id"], "paused")
                self.store.add_event(job["id"], f"Flywheel {fw['id']} paused: its last {MAX_FAILED_CYCLES} cycles "
                                                "failed; a cycle started by hand (POST .../cycles) resumes it",
                                     level="error")

    def _cycle_decided(self, job, cycle, fw, st, result, flywheels: Flywheels) -> None:
        """A cycle that ran to its end: its decision on the cycle's row; the job's end and, on a
        promotion (the registry promoted already), the alias's move in one transaction."""
        decision = st["decision"]
        flywheels.record_cycle(cycle["id"], outcome=st["outcome"], decision=decision, scores=st["scores"] or None,
                               new_failures=st["new_failures"], trace_cursor=st["trace_cursor"], usd=st["usd"],
                               version=st["version"], finished_at=utc_naive(utc_now()))
        summary = "; ".join(decision.get("reasons", []))
        if st["outcome"] == "promoted":
            name = fine_tuned_model_name(job["model"], job["tenant"], job["suffix"], job["id"])
            moved = production_update(fw["id"], name, st["version"], result["cursor"] or st["trace_cursor"])
            self._finish(job, "succeeded", f"Flywheel cycle {cycle['number']} promoted {st['version']}: {summary}",
                         cost=st["usd"], fine_tuned_model=name, model_path=result["production"]["path"], also=moved)
        else:
            flywheels.set_cursor(fw["id"], st["trace_cursor"])
            self._finish(job, "succeeded", f"Flywheel cycle {cycle['number']}: {st['outcome']}: {summary}",
                         cost=st["usd"])

    def _finish(self, job: dict[str, Any], status: str, message: str, *, cost: float | None = None,
                **fields: Any) -> None:
        """cost: the job's estimated_cost; None: the sum of its attempts in the worker's ledger."""
        tokens = _trained_tokens(self.work_dir / job["id"] / "train" / "metrics.jsonl")
        if cost is None:
            cost = sum(r.usd for r in self.ledger.read(skip_corrupt=True) if r.run == job["id"])
        self.store.finish(job["id"], self.name, status, message, trained_tokens=tokens or None,
                          estimated_cost=cost or None, **fields)
        self.log(f"{job['id']}: {status}")
        if status in ("succeeded", "failed", "cancelled"):
            self._notify(job, f"fine_tuning.job.{status}")

    def _notify(self, job: dict[str, Any], event: str) -> None:
        """Tell the tenant's webhook endpoints, each in a thread of its own (a slow receiver
        holds up no job); each outcome lands in the job's events."""
        import httpx

        def send(endpoint):
            outcome = deliver(endpoint, event, job["id"], lambda url, **kw: httpx.post(url, timeout=10, **kw))
            self.store.add_event(job["id"], outcome, level="info" if "delivered" in outcome else "warn")

        for endpoint in Webhooks(self.store.engine).endpoints(job["tenant"], event):
            threading.Thread(target=send, args=(endpoint,), name="flywheel-webhook", daemon=True).start()

    def _record_cost(self, job: dict[str, Any], seconds: float, progress: JobProgress) -> None:
        stage = f"finetune_{STAGES[job['method']['type']]}"
        self.ledger.record(stage, hardware=self.hardware, seconds=seconds, run=job["id"],
                           key=f"{job['id']}:attempt-{job['attempts']}:{self.name}",
                           extra={"tenant": job["tenant"], "to_step": progress.last_step})


class _CycleStages:
    """A running cycle's stages, published as job events as its state file reaches them."""

    def __init__(self, store: JobStore, job_id: str, cycles_dir: Path):
        self.store, self.job_id, self.cycles_dir = store, job_id, cycles_dir
        self.seen: set[tuple[str, str]] = set()

    def publish(self) -> None:
        from flywheel.loop.cycle import CycleError, read_states

        try:
            states = read_states(self.cycles_dir)
        except CycleError:  # a state file being replaced: read it at the next heartbeat
            return
        if not states:
            return
        st = states[-1]
        if (st.id, st.stage) in self.seen:
            return
        self.seen.add((st.id, st.stage))
        data = {"cycle": st.id, "stage": st.stage, "usd": st.usd}
        if st.stage == "curated":
            data["new_failures"] = st.new_failures
        if st.decision:
            data["decision"] = st.decision
        self.store.add_event(self.job_id, f"Cycle {st.id}: {st.stage}", type="message", data=data)


class JobProgress:
    """What a running job has done so far, published as events and checkpoints: each step's
    `metrics` event once across the job's attempts (an attempt that resumes from a checkpoint
    trains again the steps after it, which the attempt before may have reported; and
    metrics.jsonl holds every attempt's lines)."""

    def __init__(self, store: JobStore, job: dict[str, Any], job_dir: Path, total_steps: int, every: int):
        self.store, self.job, self.job_dir = store, job, job_dir
        self.total_steps, self.every = total_steps, every
        self.metrics_file = job_dir / "train" / "metrics.jsonl"
        self.offset = 0
        self.last_step = 0
        self.by_step: dict[int, dict[str, Any]] = {}
        self.published: set[int] = set()

    def begin(self) -> None:
        """Before an attempt trains: the steps reported so far, and an event naming the step the
        attempt resumes from when an earlier one left a checkpoint."""
        from flywheel.train.checkpoint import latest_checkpoint  # torch: only once training begins

        self.published = self.store.metric_steps(self.job["id"])
        self._metrics()  # earlier attempts' lines: what a killed worker did not get to report
        ckpt = latest_checkpoint(self.job_dir / "train")
        self.last_step = 0 if ckpt is None else int(ckpt.name.split("_")[-1])  # where this attempt starts
        if ckpt is not None:
            step = self.last_step
            self.store.add_event(self.job["id"], f"Fine-tuning job resumed from its checkpoint at step {step} "
                                 f"(attempt {self.job['attempts']})", data={"resumed_from_step": step})

    def publish(self) -> None:
        self._metrics()
        self._checkpoints()

    def _metrics(self) -> None:
        if not self.metrics_file.exists():
            return
        with open(self.metrics_file, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[:chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line a killed attempt left half-written, with the next run's appended to it
            step = int(record.get("step", 0))
            self.by_step.setdefault(step, {}).update(record)
            if "loss" in record and step > self.last_step:
                self.last_step = step
            if "loss" in record and step not in self.published:
                if step % self.every == 0 or step == self.total_steps:
                    self.published.add(step)
                    data = {"step": step, "train_loss": record["loss"], "total_steps": self.total_steps}
                    if "reward_mean" in record:
                        data["train_reward_mean"] = record["reward_mean"]
                    # every number of metrics.jsonl's row for this step, as the run's sinks got it
                    data["metrics"] = {k: v for k, v in record.items() if k not in ("step", "time")
                                       and isinstance(v, (int, float)) and not isinstance(v, bool)}
                    self.store.add_event(self.job["id"], f"Step {step}/{self.total_steps}: training loss="
                                         f"{record['loss']:.4f}", type="metrics", data=data)

    def _checkpoints(self) -> None:
        from flywheel.train.checkpoint import STATE_FILE, list_checkpoints  # torch: only once training has begun

        known = self.store.checkpoint_steps(self.job["id"])
        for ckpt in list_checkpoints(self.job_dir / "train"):
            step = int(ckpt.name.split("_")[-1])
            if step in known:
                continue
            model_dir = self.job_dir / "checkpoints" / f"step-{step}"
            try:
                _link_model(ckpt, model_dir, skip=STATE_FILE)
            except FileNotFoundError:  # training pruned it meanwhile (checkpoint.keep): a later one follows
                continue
            seen = self.by_step.get(step, {})
            metrics = {k: v for k, v in (("train_loss", seen.get("loss")), ("valid_loss", seen.get("val_loss")))
                       if v is not None}
            name = fine_tuned_model_name(self.job["model"], self.job["tenant"], self.job["suffix"], self.job["id"],
                                         step=step)
            self.store.add_checkpoint(self.job["id"], step, metrics, name, str(model_dir))


def _link_model(ckpt: Path, model_dir: Path, skip: str) -> None:
    """model_dir: the model files of training checkpoint `ckpt` (all but `skip`, the trainer
    state), hard-linked, appearing whole (built under a temporary name, then renamed)."""
    if model_dir.exists():
        return
    tmp = model_dir.with_name(f".tmp-{model_dir.name}")
    tmp.mkdir(parents=True, exist_ok=True)
    for f in ckpt.iterdir():
        if f.is_file() and f.name != skip and not (tmp / f.name).exists():
            os.link(f, tmp / f.name)
    tmp.rename(model_dir)


def _read_result(job_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((job_dir / "result.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _trained_tokens(metrics_file: Path) -> int:
    """Tokens in the loss over every step the job trained (each step once, across attempts)."""
    if not metrics_file.exists():
        return 0
    by_step: dict[int, int] = {}
    for line in metrics_file.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line a killed attempt left half-written
        if "trained_tokens" in record:
            by_step[int(record["step"])] = int(record["trained_tokens"])
    return sum(by_step.values())
