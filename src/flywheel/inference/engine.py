"""LocalEngine: batched sampling on torch (CPU or one GPU) with a KV cache.

Its one decode loop is a steppable `DecodeBatch` (inference/decode.py): `generate` admits
every prompt and steps until the batch is empty; the server's scheduler keeps one batch
running and admits requests between steps. Distinct prompts are prefilled once and fanned
out to their samples; a row that hits a stop token, a stop string or its budget leaves the
batch at once. `update_weights` copies new weights in place and `receive` picks them up
from a weight transport (zero-copy from a shared-memory reader slot); both wait for batches
pinned to the current weights and land between two steps of those that follow updates.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Mapping, Sequence

import torch

from flywheel.inference.adapters import AdapterPool
from flywheel.inference.decode import DecodeBatch, DecodeRequest
from flywheel.inference.decoder import LeanDecoder, unsupported_reason
from flywheel.inference.hf_runner import HFRunner
from flywheel.inference.prefix_cache import PrefixCache
from flywheel.inference.sampler import Sample, SamplingParams
from flywheel.models import load


class LocalEngine:
    """A `Sampler` over a Hugging Face causal LM held in this process."""

    def __init__(self, model, tokenizer, version: int = 0, lean: bool | None = None,
                 seed: int | None = None, packed: bool | None = None, max_adapters: int = 8,
                 share_prefix: bool = True, prefix_cache_mb: int = 256):
        """model: a loaded HF causal LM (the engine takes it over: it is put in eval mode and
        its q/k/v and gate/up weights become views of fused tensors). lean: force (True) or
        forbid (False) the lean forward; None picks it when the architecture allows.
        packed: the lean forward's kernel set (inference/decoder.py; None picks by size).
        max_adapters: LoRA adapters kept in memory (`adapters`, inference/adapters.py), run
        unmerged on the lean decoder's kernels (either set); the HF fallback runner has none.
        share_prefix: a prefill of prompts that start alike computes their common prefix once
        (a system prompt, tool schemas; decode.py); False: every prompt whole (for comparison).
        prefix_cache_mb: the keys and values of such prefixes kept for later prefills on the
        same weights (inference/prefix_cache.py), at most this many MiB; 0 keeps none."""
        self.share_prefix = share_prefix
        self.prefixes = PrefixCache(prefix_cache_mb << 20)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.version = version
        self.device = next(model.parameters()).device
        reason = unsupported_reason(model)
        if lean and reason:
            raise ValueError(f"lean forward unavailable: {reason}")
        self.runner = LeanDecoder(model, packed) if (lean is not False and reason is None) else HFRunner(model)
        self.adapters: AdapterPool | None = None
        self.no_adapters = "the HF fallback runner has no LoRA rows"  # why `adapters` is None
        if isinstance(self.runner, LeanDecoder):
            self.adapters = AdapterPool(self.runner.layout(), self.runner.embed.dtype, self.runner.embed.device,
                                        max_resident=max_adapters)
        # in-flight updates: called by `generate` before each decode step (it may take newer
        # weights); its batches then follow updates, their keys and values recomputed (decode.py)
        self.between_steps: Callable[[], None] | None = None
        self.eos_ids = _eos_ids(model, tokenizer)
        self.max_positions = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        # ids below it have a token; those past it (vocabulary padding rows) have none
        self.known_tokens = min(len(tokenizer), self.vocab_size)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed if seed is not None else torch.initial_seed() % (1 << 62))
        self.lock = threading.Lock()  # one forward or weight copy at a time
        self._pins = 0  # live batches pinned to the current weights (decode.py)
        self._updates_waiting = 0
        self._pins_changed = threading.Condition()
        self._params = dict(model.named_parameters(remove_duplicate=False))
        self._unique_params = dict(model.named_parameters())  # tied weights once: what a learner publishes
        self._lease = None  # the SharedMemoryReader whose leased buffer the parameters view, if any
        # seconds spent rebuilding kernels after weight changes, summed (packed kernels: the
        # reorder, a weight pickup's cost beyond moving the bytes; dense kernels: ~0)
        self.kernel_rebuild_s = 0.0

    @classmethod
    def from_path(cls, path: str, dtype: str = "float32", device: str = "cpu", **kw) -> "LocalEngine":
        model, tok = load(path, dtype=dtype, device=device)
        return cls(model, tok, **kw)

    @property
    def is_lean(self) -> bool:
        return isinstance(self.runner, LeanDecoder)

    # ------------------------------------------------------------------ weights

    def update_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy `tensors` (HF parameter names -> tensors) into the model in place; samples
        generated afterwards carry `version`. Unknown names or wrong shapes are errors and
        leave the weights untouched."""
        items = dict(tensors.items())
        for name, t in items.items():
            p = self._params.get(name)
            if p is None:
                raise KeyError(f"update_weights: unknown parameter {name!r}")
            if tuple(p.shape) != tuple(t.shape):
                raise ValueError(f"update_weights: {name!r} has shape {tuple(t.shape)}, "
                                 f"the model's is {tuple(p.shape)}")
        with self._updating():
            self._own_weights()
            for name, t in items.items():
                self._params[name].copy_(t)
            self._rebuild_kernels()
            self.version = int(version)

    def receive(self, source) -> bool:
        """Load the newest weights of `source` when they are newer than ours; True if they
        were. `source`: a flywheel.weights.WeightTransport, whose weights are copied into the
        model (`read_into`), or a SharedMemoryReader (a reader slot of a SharedMemoryTransport)
        for a zero-copy pickup: the model's parameters become views of the buffer it leases
        (no writer touches it until the next pickup moves the lease), dense kernels run on it
        and packed ones are reordered straight from it, the one copy they need. Like
        `update_weights`, a step sees the old weights or the new ones, never a mix."""
        reader = source if hasattr(source, "bind") else None
        if (reader.transport if reader else source).version() <= self.version:
            return False
        with self._updating():
            if reader is not None:
                version = reader.bind(self.model)  # checks every tensor before it leases anything
                self._lease = reader
            else:
                self._own_weights()
                version = source.read_into(self._unique_params)
            self._rebuild_kernels()
            self.version = int(version)
        return True

    def _rebuild_kernels(self) -> None:
        """After the parameters changed (held: the update lock): the lean decoder's kernels
        again (packed ones are copies), timed into `kernel_rebuild_s`."""
        if hasattr(self.runner, "refresh"):
            t0 = time.perf_counter()
            self.runner.refresh()
            self.kernel_rebuild_s += time.perf_counter() - t0

    def _own_weights(self) -> None:
        """Before writing into the parameters: if they view a leased shared buffer (never to be
        written), give them private copies and release the lease. Held: the update lock."""
        if self._lease is None:
            return
        for p in self._unique_params.values():
            p.data = p.data.clone()
        self._lease.release()
        self._lease = None

    def state_names(self) -> list[str]:
        return list(self._params)

    # ------------------------------------------------------------------ text helpers

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def generate_text(self, prompts: Sequence[str], params: SamplingParams) -> list[list[Sample]]:
        return self.generate([self.encode(p) for p in prompts], params)

    # ------------------------------------------------------------------ sampling

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 adapters: Sequence[str | None] | None = None) -> list[list[Sample]]:
        """Admit every prompt into one DecodeBatch and step it until it is empty; adapters:
        prompt i decodes with LoRA adapter adapters[i] of `self.adapters` (None: the base)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        for i, (p, sp) in enumerate(zip(prompts, params)):
            problem = self.refusal(p, sp)
            if problem is not None:
                raise ValueError(f"prompt {i}{problem}")
        if not prompts:
            return []
        in_flight = self.between_steps is not None
        batch = self.batch(follow=in_flight, recompute=in_flight and isinstance(self.runner, LeanDecoder))
        results: list[list[Sample]] = [[] for _ in prompts]
        try:
            adapters = adapters or [None] * len(prompts)
            batch.admit([DecodeRequest(i, p, sp, adapter=a)
                         for i, (p, sp, a) in enumerate(zip(prompts, params, adapters))])
            while batch.live:
                if in_flight:
                    self.between_steps()
                for i, samples in batch.step().finished:
                    for s in samples:
                        s.prompt_index = i
                    results[i] = samples
        finally:
            batch.close()
        return results

    def batch(self, *, seed: int | None = None, follow: bool = False, recompute: bool = False,
              max_rows: int = 0) -> DecodeBatch:
        """A steppable batch on this engine (inference/decode.py): admit requests, step,
        abort. seed: its own generator; follow: rows continue across weight updates;
        recompute: their keys and values recomputed under the new weights."""
        return DecodeBatch(self, seed=seed, follow=follow, recompute=recompute, max_rows=max_rows)

    def refusal(self, prompt: Sequence[int], params: SamplingParams) -> str | None:
        """Why this engine cannot decode `prompt` with `params` (the text after "prompt i"),
        or None."""
        if len(prompt) == 0:
            return " is empty"
        lo, hi = min(prompt), max(prompt)
        if lo < 0 or hi >= self.vocab_size:
            return (f" has token id {lo if lo < 0 else hi}, outside the model's vocabulary "
                    f"[0, {self.vocab_size})")
        if len(prompt) + params.max_tokens > self.max_positions:
            return (f": {len(prompt)} tokens + max_tokens {params.max_tokens} exceeds the model's "
                    f"{self.max_positions} positions")
        return None

    # ------------------------------------------------------------------ pins (decode.py)

    def pin(self) -> None:
        """A batch starts that must finish on the current weights: updates wait for it.
        Waits while an update is waiting, so a stream of batches cannot starve one."""
        with self._pins_changed:
            while self._updates_waiting:
                self._pins_changed.wait()
            self._pins += 1

    def unpin(self) -> None:
        with self._pins_changed:
            self._pins -= 1
            self._pins_changed.notify_all()

    @property
    def update_waiting(self) -> bool:
        return self._updates_waiting > 0

    @contextmanager
    def _updating(self):
        """Hold the weights for an update: wait for pinned batches to drain, then the lock."""
        with self._pins_changed:
            self._updates_waiting += 1
            try:
                while self._pins:
                    self._pins_changed.wait()
                with self.lock, torch.no_grad():
                    self.prefixes.clear()  # computed from the weights about to change
                    yield
            finally:
                self._updates_waiting -= 1
                self._pins_changed.notify_all()

    # ------------------------------------------------------------------ text of tokens

    def decode_rows(self, ids: list[list[int]]) -> list[str]:
        """The text of each row of token ids, special tokens skipped."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            # row by row in this thread: decode_batch hands rows to a thread pool, which fights
            # torch's still-spinning OpenMP workers for the cores
            return [backend.decode(row, skip_special_tokens=True) for row in ids]
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)

    def stop_string_hit(self, ids: list[int], stops: tuple[str, ...]) -> str | None:
        """The first of `stops` found in the text of the tokens' tail, or None."""
        # a stop string of c characters spans at most 4c byte-level tokens (UTF-8)
        window = 4 * max(len(s) for s in stops) + 4
        text = self.tokenizer.decode(ids[-window:], skip_special_tokens=False)
        for s in stops:
            if s in text:
                return s
        return None


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
