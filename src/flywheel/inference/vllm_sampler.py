"""VLLMSampler: the `Sampler` protocol over vLLM (token ids in; ids, per-token logprobs and
the policy version out), for rollouts on GPUs.

What vLLM does, read from its source (sampling_params.py, outputs.py, logprobs.py,
v1/sample/sampler.py, v1/engine/__init__.py, config/model.py) and its docs (training/
async_rl, training/weight_transfer, examples/offline_inference/rlhf_utils.py):
- Logprobs. `SamplingParams.logprobs=k` returns, per generated token, a dict
  {token_id: Logprob(logprob, rank, decoded_token)} holding the sampled token (its true
  rank) and the k most likely tokens (ranks 1..k); k=0 returns the sampled token alone.
  Which distribution they come from is an ENGINE argument, `logprobs_mode`:
  "raw_logprobs" (log_softmax in fp32 of the model's logits, before penalties, temperature
  and top-k/top-p) or "processed_logprobs" (after temperature and top-k/top-p; greedy rows
  of an all-greedy batch: log_softmax at temperature 1). Those are flywheel's "raw" and
  "processed" (SamplingParams); a request whose mode differs from the engine's is refused,
  never silently answered under the other distribution. The logits modes are refused.
- Finish: "stop" (eos, a stop token: `stop_reason` the id, eos: None; a stop string:
  `stop_reason` the string, the token that completed it kept in `token_ids`), "length",
  "abort" (flywheel's "cancelled"); "error" and "repetition" raise here. An eos ends with
  stop_reason None in vLLM; the Sample gets the eos id, as LocalEngine gives it.
- vLLM clamps 0 < temperature < 0.01 up to 0.01, refuses temperature > 2 and greedy with
  n > 1, and needs detokenization for stop strings: refused here before vLLM sees them.
- Weights: an engine made with `worker_extension_cls` mixes that class into every worker;
  `LLM.collective_rpc(name, args=...)` runs its method on each, where
  `self.model_runner.model.load_weights([(hf_name, tensor), ...])` takes Hugging Face names
  (q/k/v fused by the model's own loader). The prefix cache holds keys and values of the old
  weights, so it is reset after every update.

Synchronous path (`VLLMSampler`, over `vllm.LLM`): `generate` and `update_weights` hold one
lock, so a batch decodes wholly on one version and `Sample.version` is that version. Weights
travel two ways: `update_weights(tensors, version)` passes the tensors through the RPC (they
are pickled to worker processes: fine for small models and tests), and for real sizes vLLM's
workers join the run's weight broadcast group (`join_broadcast`: weights/broadcast.py, NCCL
between GPUs, the driver rank 0): each worker receives every version on its own GPU in a
thread of its own, and `receive(end)` loads the newest whole version from those buffers
into the model (`load_weights` by HF name) between batches.

In-flight updates (designed, NOT run here; needs vLLM's AsyncLLM, a recent vLLM with
`pause_generation(mode="keep")`): rows are not drained for an update.
  1. Requests stream with output_kind CUMULATIVE; each output is passed to `TokenVersions.
     observe(output, version)`, which tags the tokens that are new since the last output
     with the version current when they arrive (tested here on recorded shapes).
  2. An update: `await engine.pause_generation(mode="keep", clear_cache=True)` (the
     scheduler stops between two engine steps; requests stay queued; KV and prefix caches
     are dropped, so context is recomputed on the new weights), then the weights load via
     `collective_rpc` as above, then `self.version = v`, then `resume_generation()`.
     Rows continue on the new weights; their tokens carry v.
  3. The final output is parsed with `parse_output(..., token_versions=tags.pop(...))`, so
     `Sample.token_versions` tags every token and `Sample.version` is its first token's.
  Caveat to check on a GPU: tags are assigned on arrival; a token sampled before the pause
  whose output reaches the consumer only after resume would be tagged with the new version.
  Outputs of the last pre-pause step travel before the pause's reply on the same queue, and
  the weight load lies between, so this should not happen, but it has not been measured.
  The alternative, updating between engine steps inside the engine core without a pause, is
  not an API vLLM offers; pausing between steps is what its docs prescribe.

What has run: the pure functions and VLLMSampler against a stand-in LLM object, on CPU, with
fixtures written from vLLM's output classes (tests/data/vllm/), and the broadcast join over
gloo with a stand-in worker in the test's process. What has not: anything with a real vLLM
engine (no GPU here): the engine's actual logprobs against a learner's forward, the RPC and
NCCL weight paths, prefix-cache reset, and the whole in-flight design.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from typing import Any, Mapping, Sequence

from flywheel.config import ConfigError
from flywheel.inference.sampler import Sample, SamplingParams

EXTENSION = "flywheel.inference.vllm_sampler.WeightUpdateExtension"
INSTALL = "pip install 'flywheel[vllm]'"
ENGINE_MODES = {"raw": "raw_logprobs", "processed": "processed_logprobs"}
FINISH = {"stop": "stop", "length": "length", "abort": "cancelled"}
MAX_TEMPERATURE, MIN_SAMPLING_TEMPERATURE = 2.0, 0.01  # vLLM refuses above, clamps below


class VLLMUnavailable(ConfigError):
    """`rollout.engine: vllm` was asked for where vLLM cannot be imported."""


def require_vllm():
    """The vllm module, or VLLMUnavailable saying how to install it. Call at run start, so
    a run without vLLM fails before any work, never mid-run."""
    try:
        import vllm
    except Exception as e:  # ImportError, or a broken install (CUDA libraries missing)
        raise VLLMUnavailable(
            f"rollout.engine: vllm needs the vllm package, which cannot be imported here ({e}). "
            f"Install it with `{INSTALL}` (vLLM needs a CUDA GPU); on a machine without one use "
            "rollout.engine: local") from e
    return vllm


# ---------------------------------------------------------------------------- requests


def build_sampling_params(params: SamplingParams, *, engine_logprobs_mode: str = "raw_logprobs",
                          max_logprobs: int = 20, seed: int | None = None) -> dict[str, Any]:
    """The keyword arguments of `vllm.SamplingParams` for `params` on an engine made with
    `logprobs_mode=engine_logprobs_mode` and `max_logprobs`. Raises ValueError naming the
    field for what vLLM would refuse, alter or answer under another distribution."""
    wanted = ENGINE_MODES[params.logprobs_mode]
    if engine_logprobs_mode not in ENGINE_MODES.values():
        raise ValueError(f"engine logprobs_mode {engine_logprobs_mode!r} is not supported: flywheel reads "
                         f"log-probabilities, so the engine must run with one of {sorted(ENGINE_MODES.values())}")
    if wanted != engine_logprobs_mode:
        raise ValueError(
            f"logprobs_mode={params.logprobs_mode!r} needs a vLLM engine made with logprobs_mode={wanted!r}, "
            f"this one has {engine_logprobs_mode!r} (an engine argument, one per engine): make the VLLMSampler "
            f"with logprobs_mode={params.logprobs_mode!r}")
    t = params.temperature
    if t > MAX_TEMPERATURE:
        raise ValueError(f"temperature={t} is above {MAX_TEMPERATURE}, which vLLM refuses")
    if 0 < t < MIN_SAMPLING_TEMPERATURE:
        raise ValueError(f"temperature={t}: vLLM raises temperatures in (0, {MIN_SAMPLING_TEMPERATURE}) to "
                         f"{MIN_SAMPLING_TEMPERATURE}, changing the distribution; use 0 (greedy) or >= "
                         f"{MIN_SAMPLING_TEMPERATURE}")
    greedy = t == 0
    if greedy and params.n > 1:
        raise ValueError(f"n={params.n} with temperature=0: vLLM refuses greedy decoding with n > 1 "
                         "(the samples would be identical); ask n=1")
    if max_logprobs != -1 and params.top_logprobs > max_logprobs:
        raise ValueError(f"top_logprobs={params.top_logprobs} exceeds the engine's max_logprobs={max_logprobs}")
    kw: dict[str, Any] = {
        "n": params.n,
        "temperature": float(t),
        # greedy: vLLM drops top-p/top-k itself; dropping them here too keeps the processed
        # logprobs of a greedy row at temperature 1 unfiltered in mixed batches as well
        "top_p": 1.0 if greedy else float(params.top_p),
        "top_k": 0 if greedy else int(params.top_k),
        "max_tokens": params.max_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        "stop": list(params.stop),
        "include_stop_str_in_output": False,  # Sample.text excludes the stop string
        "ignore_eos": params.ignore_eos,
        "logprobs": params.top_logprobs,  # 0: the sampled token's logprob alone
        "detokenize": True,  # Sample.text; stop strings need it
        "skip_special_tokens": True,  # as LocalEngine.decode_rows
    }
    if seed is not None:
        kw["seed"] = int(seed)
    return kw


# ---------------------------------------------------------------------------- responses


def parse_output(output, version: int, *, prompt_index: int = 0, top_logprobs: int = 0,
                 token_versions: Mapping[int, Sequence[int]] | None = None) -> list[Sample]:
    """The Samples of one vLLM RequestOutput (duck-typed: `.outputs[i].token_ids`,
    `.logprobs[j][token_id].logprob`, `.finish_reason`, `.stop_reason`, `.text`), in
    completion-index order. `version`: the weights' version that produced them;
    token_versions: per completion index, each token's version (in-flight updates)."""
    prompt_len = len(getattr(output, "prompt_token_ids", None) or ())
    samples = []
    for c in sorted(output.outputs, key=lambda c: c.index):
        where = f"request {getattr(output, 'request_id', '?')!r} completion {c.index}"
        ids = [int(t) for t in c.token_ids]
        if c.logprobs is None:
            raise ValueError(f"{where} has no logprobs: the request was made without SamplingParams.logprobs")
        if len(c.logprobs) != len(ids):
            raise ValueError(f"{where}: {len(ids)} tokens but {len(c.logprobs)} logprob positions")
        lps, tops = [], []
        for j, (tok, position) in enumerate(zip(ids, c.logprobs)):
            entry = position.get(tok)
            if entry is None:
                raise ValueError(f"{where}: token {j} ({tok}) is missing from its logprobs {sorted(position)}")
            lps.append(_logprob(entry))
            if top_logprobs:
                tops.append(_alternatives(position, top_logprobs))
        reason = c.finish_reason
        if reason not in FINISH:
            raise ValueError(f"{where} finished with {reason!r}" if reason else f"{where} has not finished")
        stop_reason = c.stop_reason
        if reason == "stop" and stop_reason is None and ids:
            stop_reason = ids[-1]  # an eos token; vLLM reports None
        tags = None
        if token_versions is not None:
            tags = [int(v) for v in token_versions.get(c.index, ())]
            if len(tags) != len(ids):
                raise ValueError(f"{where}: {len(ids)} tokens but {len(tags)} version tags")
        samples.append(Sample(token_ids=ids, logprobs=lps, finish_reason=FINISH[reason],
                              version=tags[0] if tags else int(version), prompt_index=prompt_index,
                              stop_reason=stop_reason, text=c.text, prompt_len=prompt_len,
                              top_logprobs=tops if top_logprobs else None, token_versions=tags))
    return samples


def _logprob(entry) -> float:
    return float(getattr(entry, "logprob", entry))


def _alternatives(position: Mapping, k: int) -> list[tuple[int, float]]:
    """The k best of one position's {token_id: Logprob}: by vLLM's rank (the sampled token
    sits at its true rank, the top-k at 1..k), tokens outside a filtered support dropped."""
    entries = [(int(t), _logprob(e), getattr(e, "rank", None)) for t, e in position.items()]
    entries.sort(key=lambda x: (x[2] if x[2] is not None else math.inf, -x[1]))
    return [(t, lp) for t, lp, _ in entries[:k] if lp != -math.inf]


class TokenVersions:
    """Per-token version tags for streamed (CUMULATIVE) outputs: `observe` tags the tokens
    that are new since a completion's last output with the version current on arrival."""

    def __init__(self):
        self._tags: dict[tuple[str, int], list[int]] = {}

    def observe(self, output, version: int) -> None:
        for c in output.outputs:
            tags = self._tags.setdefault((output.request_id, c.index), [])
            grown = len(c.token_ids) - len(tags)
            if grown < 0:
                raise ValueError(f"request {output.request_id!r} completion {c.index} shrank: outputs must be "
                                 "CUMULATIVE, not DELTA")
            tags.extend([int(version)] * grown)

    def pop(self, request_id: str) -> dict[int, list[int]]:
        """The tags of a finished request, by completion index, forgotten here."""
        keys = [k for k in self._tags if k[0] == request_id]
        return {k[1]: self._tags.pop(k) for k in keys}


# ---------------------------------------------------------------------------- the sampler


class VLLMSampler:
    """A `Sampler` over a `vllm.LLM` in this process (its workers may be other processes).
    model: a Hugging Face folder; logprobs_mode: flywheel's "raw" or "processed", fixed per
    engine; engine_kwargs go to vllm.LLM (tensor_parallel_size, gpu_memory_utilization,
    dtype, ...). llm / params_factory: an existing engine (or a stand-in, in tests) and the
    maker of its SamplingParams, used instead of importing vLLM."""

    def __init__(self, model: str | None = None, *, version: int = 0, logprobs_mode: str = "raw",
                 max_logprobs: int = 20, seed: int | None = None, llm=None, params_factory=None,
                 **engine_kwargs):
        if logprobs_mode not in ENGINE_MODES:
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {logprobs_mode!r}")
        self.version = int(version)
        self.logprobs_mode = logprobs_mode
        self.max_logprobs = max_logprobs
        self._lock = threading.Lock()  # one generate or weight update at a time
        if llm is None:
            if model is None:
                raise ValueError("VLLMSampler needs a model folder (or an llm)")
            vllm = require_vllm()
            if seed is not None:
                engine_kwargs["seed"] = seed
            llm = vllm.LLM(model=model, logprobs_mode=ENGINE_MODES[logprobs_mode], max_logprobs=max_logprobs,
                           worker_extension_cls=EXTENSION, **engine_kwargs)
            params_factory = params_factory or vllm.SamplingParams
        self.llm = llm
        self._params = params_factory or (lambda **kw: kw)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` by the engine's tokenizer, no special tokens (as LocalEngine)."""
        return self.llm.get_tokenizer().encode(text, add_special_tokens=False)

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[list[Sample]]:
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        requests = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            try:
                kw = build_sampling_params(sp, engine_logprobs_mode=ENGINE_MODES[self.logprobs_mode],
                                           max_logprobs=self.max_logprobs)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            requests.append(self._params(**kw))
        if not prompts:
            return []
        with self._lock:
            version = self.version
            outputs = self.llm.generate([{"prompt_token_ids": [int(t) for t in p]} for p in prompts],
                                        requests, use_tqdm=False)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
        return [parse_output(out, version, prompt_index=i, top_logprobs=sp.top_logprobs)
                for i, (out, sp) in enumerate(zip(outputs, params))]

    def update_weights(self, tensors: Mapping[str, Any], version: int) -> None:
        """Load `tensors` (Hugging Face names -> tensors) into every worker through the RPC;
        samples generated afterwards carry `version`."""
        named = list(tensors.items())
        with self._lock:
            self.llm.collective_rpc("flywheel_load_weights", args=(named,))
            self._after_update(version)

    def join_broadcast(self, host: str, port: int, rank: int, world_size: int,
                       specs: Sequence[tuple[str, str, Sequence[int]]], backend: str) -> "WorkerBroadcast":
        """Join the run's weight broadcast group (weights/broadcast.py, `rollout.ray.weights:
        broadcast`) from inside vLLM's worker: worker w is rank `rank + w`, its receiving end
        on the worker's own device, so under NCCL the weights go GPU to GPU straight into the
        worker, never through this process. specs: (name, dtype, shape) of every tensor the
        publisher sends. Returns this process's view of that end, for `receive`. Joining again
        (the group formed anew) replaces the old end."""
        end = secrets.token_hex(4)  # names this end, so closing it later spares a newer one
        self.llm.collective_rpc("flywheel_join_broadcast", args=(
            host, port, rank, world_size, [(n, d, list(sh)) for n, d, sh in specs], backend, end))
        return WorkerBroadcast(self.llm, end)

    def receive(self, source: "WorkerBroadcast") -> bool:
        """Load the newest version the workers' broadcast ends hold, when newer than ours;
        True if it was. Like `update_weights`, a batch decodes wholly on one version."""
        with self._lock:
            versions = self.llm.collective_rpc("flywheel_load_broadcast", args=(self.version,))
            if min(versions) != max(versions):
                raise RuntimeError(f"vLLM's workers hold different weight versions {versions}")
            if versions[0] <= self.version:
                return False
            self._after_update(versions[0])
        return True

    def _after_update(self, version: int) -> None:
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None and reset() is False:
            raise RuntimeError("vLLM did not reset its prefix cache after a weight update: prompts sharing a "
                               "prefix would reuse keys and values of the old weights")
        self.version = int(version)


class WorkerBroadcast:
    """The broadcast group's receiving ends inside vLLM's workers, as the rollout actor sees
    them (the WeightTransport reader surface GroupWeights uses): version, error, wait_newer,
    close, each a collective_rpc. The version is the oldest any worker has whole."""

    POLL_S = 0.05

    def __init__(self, llm, end: str):
        self.llm, self.end = llm, end

    def _states(self) -> list[tuple[int, str | None]]:
        return self.llm.collective_rpc("flywheel_broadcast_state")

    def version(self) -> int:
        return min(v for v, _ in self._states())

    @property
    def error(self) -> str | None:
        errors = [e for _, e in self._states() if e is not None]
        return errors[0] if errors else None

    def wait_newer(self, than: int, timeout_s: float | None = None) -> int:
        """Poll until every worker holds a version newer than `than`; raises what broke the group."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            states = self._states()
            errors = [e for _, e in states if e is not None]
            newest = min(v for v, _ in states)
            if newest > than:
                return newest
            if errors:
                raise RuntimeError(f"the weight group broke: {errors[0]}")
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no weights newer than v{than} within {timeout_s} s")
            time.sleep(self.POLL_S)

    def close(self) -> None:
        self.llm.collective_rpc("flywheel_leave_broadcast", args=(self.end,))


class WeightUpdateExtension:
    """Mixed into each vLLM worker by `worker_extension_cls=EXTENSION`; runs there, where
    `self.model_runner.model` is the model and `self.device` its device. Methods are
    prefixed so that they cannot collide with the worker's own."""

    def flywheel_load_weights(self, named_tensors) -> None:
        self.model_runner.model.load_weights(weights=[(n, t.to(self.device)) for n, t in named_tensors])

    def flywheel_join_broadcast(self, host: str, port: int, rank_offset: int, world_size: int, specs,
                                backend: str, end: str) -> None:
        import torch

        from flywheel.weights.broadcast import BroadcastTransport

        like = {n: torch.empty(shape, dtype=getattr(torch, d), device="meta") for n, d, shape in specs}
        device = str(self.device) if backend == "nccl" else "cpu"
        fresh = BroadcastTransport.receiver(like, host, port, rank_offset + self.rank, world_size, backend, device)
        old = getattr(self, "_flywheel_broadcast", None)
        self._flywheel_broadcast, self._flywheel_broadcast_end = fresh, end
        if old is not None:
            old.close()

    def flywheel_load_broadcast(self, than: int) -> int:
        """Load the group's newest version into the model when newer than `than` (the
        received buffers' views go to the loader: under NCCL already on this device); its
        version, else `than`."""
        with self._flywheel_broadcast.current() as (version, tensors):
            if version > than:
                self.model_runner.model.load_weights(weights=[(n, t.to(self.device)) for n, t in tensors.items()])
                return version
        return than

    def flywheel_broadcast_state(self) -> tuple[int, str | None]:
        end = getattr(self, "_flywheel_broadcast", None)
        if end is None:
            return -1, "this vLLM worker has not joined a weight broadcast group"
        return end.version(), None if end.error is None else str(end.error)

    def flywheel_leave_broadcast(self, end: str) -> None:
        """Close the receiving end named `end`, if it is still this worker's."""
        if getattr(self, "_flywheel_broadcast_end", None) == end:
            transport, self._flywheel_broadcast = self._flywheel_broadcast, None
            transport.close()

    def flywheel_weight_sum(self, name: str) -> float:
        """A parameter's sum as vLLM holds it (vLLM's own name), to check an update landed."""
        return float(dict(self.model_runner.model.named_parameters())[name].float().sum())


def to_json(output) -> dict:
    """A RequestOutput as JSON, in the shape of tests/data/vllm/ (to record real outputs on a
    GPU: json.dump(to_json(out), f)). Logprob dict keys become strings, as JSON needs."""
    def position(p):
        return {str(t): {"logprob": _logprob(e), "rank": getattr(e, "rank", None),
                         "decoded_token": getattr(e, "decoded_token", None)} for t, e in p.items()}

    return {"request_id": output.request_id, "prompt": output.prompt,
            "prompt_token_ids": list(output.prompt_token_ids or []), "prompt_logprobs": None,
            "outputs": [{"index": c.index, "text": c.text, "token_ids": list(c.token_ids),
                         "cumulative_logprob": c.cumulative_logprob,
                         "logprobs": None if c.logprobs is None else [position(p) for p in c.logprobs],
                         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                         "lora_request": None} for c in output.outputs],
            "finished": output.finished, "metrics": None, "lora_request": None,
            "encoder_prompt": None, "encoder_prompt_token_ids": None,
            "num_cached_tokens": getattr(output, "num_cached_tokens", None)}
