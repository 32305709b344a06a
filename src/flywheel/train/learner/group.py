"""A learner of several ranks, driven from run_rl's process as if it were one.

run_rl (train/rl.py) keeps the rollouts, the feeder, evaluation and the logs; the learner's
ranks (rl_learner.py's RLLearner, each holding 1/world of the sharded model) run elsewhere.
`LearnerGroup` gives run_rl the learner's four calls: each is sent to every rank with the same
arguments (the ranks join the same collectives in the same order), and rank 0's answer is
returned; the other ranks answer None / {}. Two ways to run the ranks:

- `ProcessLearner`: `train.world_size` local processes (rank_processes.py's RankProcesses), one
  socket each to this process, messages plain pickles (torch's fd-passing reductions need a
  multiprocessing parent, which these fresh interpreters do not have); weights come back
  through a shared-memory segment instead (rank 0 publishes, this process leases the newest
  buffer without a copy);
- `RayLearner` (ray_actors.py): one Ray actor per rank, placed by `rollout.ray.learner_*`.

Failure. A rank that raises sends its exception and exits; one that dies (SIGKILL, its node
lost) closes its connection. Either way every rank is stopped at once (the others would wait
in a collective) and the call raises: the rank's own exception, or TrainError naming the rank
and how it died. The driver's checkpoints are written whole or not at all, so `resume: true`
continues from the newest one exactly as after a single-process kill.
"""

from __future__ import annotations

import pickle
import signal
import time
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from flywheel.config import RLConfig
from flywheel.errors import TrainError


class LearnerGroup:
    """run_rl's learner over ranks that `_call` reaches; subclasses say how."""

    world_size: int

    def update(self, groups: list) -> dict[str, float]:
        return self._call("update", groups)

    def weights(self) -> Mapping[str, torch.Tensor]:
        return self._call("weights")

    def save_checkpoint(self, step: int, extra: dict) -> Path:
        return self._call("save_checkpoint", step, extra)

    def save_final(self, dest: Path) -> None:
        self._call("save_final", dest)

    def placement(self) -> list[dict]:
        return []  # local ranks; RayLearner says where its actors are

    def _call(self, name: str, *args) -> Any:
        return self._call_all(name, *args)[0]

    def _call_all(self, name: str, *args) -> list:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class ProcessLearner(LearnerGroup):
    """`cfg.train.world_size` ranks as local processes (output_dir/fsdp2: ranks.json, logs).
    `like`: the weights' names, shapes and dtypes (the plain model's parameters), the layout
    of the hand-off segment (its name recorded in output_dir/HANDOFF_RECORD)."""

    def __init__(self, cfg: RLConfig, ckpt: Path | None, like: Mapping[str, torch.Tensor],
                 log: Callable[[str], None] = print, threads: int | None = None):
        from flywheel.train.learner.rank_processes import RankProcesses
        from flywheel.weights.shm import SharedMemoryTransport, recorded_segment_name

        self.world_size = cfg.train.world_size
        self._record = Path(cfg.output_dir) / HANDOFF_RECORD
        self.handoff = SharedMemoryTransport.create(like, name=recorded_segment_name(self._record, log), readers=1)
        self.reader = self.handoff.reader()
        self._closed = False
        device = "cuda" if cfg.device.startswith("cuda") else cfg.device
        payload = {"cfg": cfg.model_dump(mode="json"), "ckpt": None if ckpt is None else str(ckpt),
                   "handoff": self.handoff.name}
        try:
            self.ranks = RankProcesses("flywheel.train.learner.group:_serve", payload, self.world_size, device,
                                       cfg.output_dir, log, threads, channels=True)
        except BaseException:
            self._close_handoff()
            raise
        try:
            self._collect()  # each rank answers once its learner is built (and restored)
        except BaseException:
            self.close()
            raise

    def weights(self) -> Mapping[str, torch.Tensor]:
        """The newest weights: views of the hand-off buffer rank 0 just wrote, leased to this
        process until the next call (never written to meanwhile)."""
        self._call("weights")
        return self.reader.acquire()[1]

    def _call_all(self, name: str, *args) -> list:
        message = pickle.dumps((name, args))
        for conn in self.ranks.conns:
            try:
                conn.send_bytes(message)
            except (BrokenPipeError, OSError):
                pass  # that rank is gone: _collect names it
        return self._collect()

    def _collect(self) -> list:
        """Every rank's answer to the last call, in rank order; on a failure, stop all, raise."""
        conns = self.ranks.conns
        answers: dict[int, Any] = {}
        while len(answers) < len(conns):
            waiting = [c for r, c in enumerate(conns) if r not in answers]
            errors, closed = [], False
            for conn in wait(waiting, timeout=1.0):
                try:
                    kind, value = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    closed = True
                    continue
                if kind == "error":
                    errors.append(value)
                else:
                    answers[conns.index(conn)] = value
            if errors or closed:  # the cause rather than a peer's failed collective, where both came
                own = [e for e in errors if not isinstance(e, getattr(torch.distributed, "DistError", ()))]
                self._fail((own or errors or [None])[0])
            if len(answers) < len(conns) and self.ranks.dead() is not None:
                self._fail(None)
        return [answers[r] for r in range(len(conns))]

    def _fail(self, error: BaseException | None):
        """Stop every rank and raise the cause: a rank killed by a signal (the others then fail
        in a collective), else the exception a rank sent, else how the first rank exited."""
        deadline = time.monotonic() + 2.0
        while self.ranks.dead() is None and time.monotonic() < deadline:
            time.sleep(0.02)  # a closed connection comes a moment before its process is reaped
        codes = [p.poll() for p in self.ranks.procs]
        signalled = [r for r, c in enumerate(codes) if c is not None and c < 0]
        self.ranks.kill()
        self._closed = True
        self._close_handoff()
        if signalled:
            self.ranks.raise_failure(signalled[0])
        if error is not None:
            raise error
        first = next((r for r, c in enumerate(codes) if c is not None), 0)
        self.ranks.raise_failure(first)

    def close(self) -> None:
        """Let the ranks exit (SIGKILL after 30 s); remove the hand-off segment."""
        if self._closed:
            return
        self._closed = True
        for conn in self.ranks.conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 30.0
        while any(p.poll() is None for p in self.ranks.procs) and time.monotonic() < deadline:
            time.sleep(0.02)
        self.ranks.kill()
        self._close_handoff()

    def _close_handoff(self) -> None:
        self.reader.close()
        self.handoff.close()
        self._record.unlink(missing_ok=True)


def serve(learner_factory: Callable[[], Any], receive: Callable[[], Any], answer: Callable[[tuple], None],
          hand_off: Callable[[Mapping], Any]) -> None:
    """A rank's loop: build the learner, answer ("ok", None); then for each (name, args)
    received, answer ("ok", learner.name(*args)) until None arrives; what `weights` returns
    goes through hand_off(weights) and its result is the answer. An exception is answered
    ("error", it) and raised (the rank exits: its peers may be stuck in a collective)."""
    try:
        learner = learner_factory()
    except BaseException as e:
        answer(("error", _picklable(e)))
        raise
    answer(("ok", None))
    while (message := receive()) is not None:
        name, args = message
        try:
            if name not in CALLS:
                raise KeyError(f"a learner rank has no call {name!r} (it answers {', '.join(CALLS)})")
            value = getattr(learner, name)(*args)
            if name == "weights":
                value = hand_off(value)
        except BaseException as e:
            answer(("error", _picklable(e)))
            raise
        answer(("ok", value))


HANDOFF_RECORD = "learner-weights.shm"  # the hand-off segment's name, for cleanup after a kill
CALLS = ("update", "weights", "save_checkpoint", "save_final")  # what a rank answers (RLLearner's)


def _picklable(e: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return TrainError(f"{type(e).__name__}: {e}")


def _serve(payload: dict, rank) -> None:
    """A local rank (rank_processes.py runs it): serve run_rl over `rank.channel`."""
    from flywheel.train.learner.rl_learner import RLLearner
    from flywheel.train.run_state import seed_everything

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the driver decides
    cfg = RLConfig.model_validate(payload["cfg"])
    seed_everything(cfg.train.seed)
    ckpt = None if payload["ckpt"] is None else Path(payload["ckpt"])
    log = (lambda m: print(m, flush=True)) if rank.is_main else (lambda m: None)
    conn = rank.channel

    def receive():
        try:
            return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return None  # the driver is gone

    handoff, versions = None, iter(range(1 << 62))

    def hand_off(weights: Mapping) -> None:  # rank 0 publishes into the driver's segment; others hold {}
        nonlocal handoff
        if weights:
            if handoff is None:
                from flywheel.weights.shm import SharedMemoryTransport

                handoff = SharedMemoryTransport.attach(payload["handoff"])
            handoff.publish(weights, next(versions))

    serve(lambda: RLLearner(cfg, ckpt, rank, log), receive, lambda a: conn.send_bytes(pickle.dumps(a)), hand_off)
