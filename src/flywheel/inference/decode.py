"""DecodeBatch: LocalEngine's one decode loop, steppable. Rollouts (`LocalEngine.generate`)
and serving (the scheduler) both run it.

A batch holds sample rows decoded together, one token per live row per `step()`:
- `admit(requests)` prefills the requests' distinct prompts in one forward and fans each
  out to its `n` rows. A prefix they share (a system prompt, tool schemas) is computed once,
  or taken from the engine's prefix cache when an earlier prefill on the same weights
  computed it (inference/prefix_cache.py). On the lean decoder a batch that is already decoding takes them
  (they join at the current cache column); on the HF fallback only an empty one does
  (`can_join`).
- `step()` samples a token for every live row from the last forward's logits, records
  it, evicts the rows that finished (stop token, stop string, token budget, aborted) and
  runs one decode forward for the rest. It returns what it sampled and the requests that
  completed, with their `Sample`s.
- `abort(key)`: the request's rows leave at the next step (that step's token dropped);
  it completes with what it has, those rows' finish_reason "cancelled".

Weights (`follow`): False (the default) pins the engine's weights while the batch has
rows: `update_weights` waits until it drains, and the batch takes no request while an
update waits, so every token of a sample comes from one version. True lets an update land
between two steps: rows continue on the new weights (the keys and values already cached
stay), and `Sample.token_versions` tags each token with the version whose forward produced
its logits. With `recompute` as well (lean decoder), the first step after an update first
recomputes every live row's keys and values under the new weights (one prefill of each row's
prompt and tokens so far), so from the update on each token is what the new weights give on
the whole mixed sequence, exactly as a fresh forward of it would.

LoRA: a request may name an adapter of the engine's AdapterPool (inference/adapters.py);
its rows decode with it, unmerged, beside rows of other adapters and of the base model in the
same forwards (inference/lora.py). Rows share a prefill only when prompt and adapter agree; a
prefix the prompts share is computed (or cached) once per adapter among them and the base.

Seeds: a batch with `seed` draws from a generator of its own seeded with it, so its
samples depend on the seed and its requests alone; without one it shares the engine's.
Sampling noise is drawn per batch position and a finished row's place goes to the last
row, so the samples of a request depend on the rows decoded beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import torch

from flywheel.inference.decoder import KVCache, LeanDecoder, SharedPrefix
from flywheel.inference.lora import AdapterError, Resident, RowGroups
from flywheel.inference.logits import Needs, processed_logprobs, reported_logprobs, sample_tokens, top_logprobs, top_pairs
from flywheel.inference.sampler import Sample, SamplingParams

TopPairs = list[tuple[int, float]]  # one token's alternatives: (id, logprob), best first
SHARED_PREFIX_MIN = 16  # tokens all of an admit's distinct prompts must share before they are computed once


@dataclass(frozen=True)
class DecodeRequest:
    """One prompt to decode `params.n` times. `key` names it in what `step` returns."""

    key: Hashable
    prompt: Sequence[int]
    params: SamplingParams
    adapter: str | None = None  # the LoRA adapter to decode with (one the engine's AdapterPool has), None: the base


@dataclass
class StepOutput:
    """What one `step` sampled, aligned by row: row b belongs to request `keys[b]` (its
    sample `indices[b]`), drew `tokens[b]` with `logprobs[b]` (alternatives `tops[b]` when
    its request asked for top_logprobs, else None) from the weights of `versions[b]`.
    Rows of aborted requests are left out. `finished`: the requests that completed at this
    step, with their samples (ordered by sample index)."""

    keys: list[Hashable]
    indices: list[int]
    tokens: list[int]
    logprobs: list[float]
    tops: list[TopPairs | None]
    versions: list[int]
    finished: list[tuple[Hashable, list[Sample]]] = field(default_factory=list)


class _Row:
    """Host-side state of one sample row."""

    __slots__ = ("request", "index", "strings", "top", "tokens", "logprobs", "tops", "versions", "finish")

    def __init__(self, request: "_Request", index: int, sp: SamplingParams):
        self.request, self.index = request, index
        self.strings, self.top = sp.stop, sp.top_logprobs
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[TopPairs] = []
        self.versions: list[int] = []  # per token, when the batch follows weight updates
        self.finish: tuple[str, int | str | None] | None = None  # (finish_reason, stop_reason)


class _Request:
    __slots__ = ("key", "prompt", "prompt_len", "rows", "left", "version", "aborted", "lora")

    def __init__(self, r: DecodeRequest, version: int, lora: Resident | None):
        self.key, self.prompt_len, self.version, self.lora = r.key, len(r.prompt), version, lora
        self.prompt = tuple(r.prompt)  # for a recompute after a weight update (recompute batches)
        self.rows: list[_Row] = []
        self.left = r.params.n  # rows still generating
        self.aborted = False


class DecodeBatch:
    """See the module doc. Not thread-safe: one thread admits, steps and aborts (abort
    only sets a flag and may come from another thread)."""

    # per-row tensors, aligned with `rows` and the cache rows
    _ROW_TENSORS = ("temperature", "top_k", "top_p", "processed", "stop_ids", "budget", "count", "pos_next", "start")

    def __init__(self, engine, *, seed: int | None = None, follow: bool = False, recompute: bool = False,
                 max_rows: int = 0):
        """engine: a LocalEngine. max_rows: row room to reserve when the cache grows.
        follow / recompute: see the module doc."""
        self.engine = engine
        self.runner = engine.runner
        self.dev = engine.device
        self.follow = follow
        self.max_rows = max_rows
        self.can_join_running = isinstance(self.runner, LeanDecoder)
        if recompute and not (follow and self.can_join_running):
            raise ValueError("recompute needs follow=True and the lean decoder (the HF fallback runner's cache "
                             "cannot be rewritten in place)")
        self.recompute = recompute
        self.cache_version: int | None = None  # the weights of every key and value cached (recompute batches)
        if seed is None:
            self.generator = engine.generator
        else:
            self.generator = torch.Generator(device=self.dev)
            self.generator.manual_seed(int(seed))
        self.rows: list[_Row] = []
        self.requests: dict[Hashable, _Request] = {}
        self._pinned = False
        self.buf = None  # lean: (layers, 2, row room, kv heads, column room, head dim)
        self.cache = None  # lean: KVCache over buf[:, :, :len(rows)]; HF: the runner's cache
        self.logits = None  # (B, V): each row's next token is sampled from these
        self.logits_version: list[int] = []  # (B,) the version whose forward made each row's logits
        for name in self._ROW_TENSORS:
            setattr(self, name, None)
        self.needs: Needs | None = None
        self.any_processed = self.all_processed = False
        self.k_max = 0  # most alternatives per token any row asks for
        self.any_strings = False
        self.padded = False  # some row cannot see column 0: attention needs a mask
        self.lora: RowGroups | None = None  # each row's LoRA adapter, grouped (None rows: the base)

    # ------------------------------------------------------------------ state

    @property
    def live(self) -> int:
        """Sample rows still generating."""
        return len(self.rows)

    @property
    def can_join(self) -> bool:
        """Whether `admit` takes requests now: the batch is empty, or it runs on the lean
        decoder and no weight update waits on it."""
        if not self.rows:
            return True
        return self.can_join_running and not (self._pinned and self.engine.update_waiting)

    def abort(self, key: Hashable) -> None:
        """The request's rows leave at the next step (see the module doc)."""
        r = self.requests.get(key)
        if r is not None:
            r.aborted = True

    # ------------------------------------------------------------------ admitting

    def admit(self, requests: Sequence[DecodeRequest]) -> None:
        """Prefill `requests` (one forward) into the batch. A request the engine would refuse
        raises ValueError naming it, and nothing is admitted."""
        if not requests:
            return
        if not self.can_join:
            raise RuntimeError("this batch takes no request now (HF fallback runner decoding, or a "
                               "weight update waiting on it)")
        engine = self.engine
        loras: dict[Hashable, Resident] = {}
        for r in requests:
            if r.adapter is not None:
                if engine.adapters is None:
                    raise ValueError(f"request {r.key!r}: adapter {r.adapter!r}, but this engine serves no adapters: "
                                     f"{engine.no_adapters}")
                try:
                    loras[r.key] = engine.adapters.get(r.adapter)
                except AdapterError as e:
                    raise ValueError(f"request {r.key!r}: {e}") from None
            problem = engine.refusal(r.prompt, r.params)
            if problem is not None:
                raise ValueError(f"request {r.key!r}{problem}")
            if r.key in self.requests:
                raise ValueError(f"request {r.key!r} is already in the batch")
        if not self._pinned and not self.follow:
            engine.pin()
            self._pinned = True
        try:
            with engine.lock:
                self._prefill(requests, loras)
        except BaseException:
            if not self.rows:
                self._release()
            raise

    def _prefill(self, requests: Sequence[DecodeRequest], loras: dict[Hashable, Resident]) -> None:
        engine, dev = self.engine, self.dev
        unique: dict[tuple[tuple[int, ...], str | None], int] = {}  # (prompt, adapter): rows sharing a prefill
        for r in sorted(requests, key=lambda r: (r.adapter is not None, r.adapter or "")):  # an adapter's prompts
            unique.setdefault((tuple(r.prompt), r.adapter), len(unique))  # side by side: its tokens one slice
        uniq = [prompt for prompt, _ in unique]
        uniq_lora = [None] * len(unique)
        lens = [len(u) for u in uniq]
        P = max(lens)
        pad = 0 if engine.tokenizer.pad_token_id is None else engine.tokenizer.pad_token_id
        new_rows, rows_uniq, settings = [], [], []
        for r in requests:
            req = _Request(r, engine.version, loras.get(r.key))
            u = unique[(tuple(r.prompt), r.adapter)]
            uniq_lora[u] = req.lora
            for i in range(r.params.n):
                row = _Row(req, i, r.params)
                req.rows.append(row)
                new_rows.append(row)
                rows_uniq.append(u)
                settings.append(r.params)
        R, B = len(new_rows), len(self.rows)
        with torch.inference_mode():
            tokens_U_P = torch.tensor([[pad] * (P - len(u)) + list(u) for u in uniq], device=dev)
            lens_U = torch.tensor(lens, device=dev)
            offset_U = P - lens_U
            positions_U_P = (torch.arange(P, device=dev)[None] - offset_U[:, None]).clamp_min(0)
            key_valid_U_P = torch.arange(P, device=dev)[None] >= offset_U[:, None] if min(lens) < P else None
            row_uniq = torch.tensor(rows_uniq, device=dev)
            budget = max(sp.max_tokens for sp in settings)
            if B == 0:
                c = P
                target = self.runner.new_cache(R, P + budget)
                if self.can_join_running:
                    self.buf = target.kv
            else:  # lean: prefill straight into rows [B, B + R) of the buffer, columns [c - P, c)
                c = self._make_room(R, P, budget)
                # the columns before are masked for these rows, but must hold numbers, not
                # leftover garbage (a NaN there times an attention weight of 0 would still leak)
                if c > P:
                    self.buf[:, :, B:B + R, :, :c - P].zero_()
                target = KVCache(self.buf[:, :, B:B + R, :, c - P:], 0)
            prefix = self._prefix(uniq, uniq_lora)
            if prefix is not None:  # the prompts' common prefix once (or cached), then each prompt's rest on it
                logits = self._prefill_on_prefix(uniq, uniq_lora, prefix, P, pad, target, row_uniq
                                                 ).index_select(0, row_uniq)
            else:
                logits = self.runner.forward(tokens_U_P, positions_U_P, target, key_valid_U_P, causal=True,
                                             cache_rows=row_uniq, **_lora(RowGroups(uniq_lora, P, dev))
                                             ).index_select(0, row_uniq)
            stops = [sorted(set(sp.stop_token_ids) | (set() if sp.ignore_eos else engine.eos_ids)) for sp in settings]
            width = max(1, max(len(s) for s in stops))
            f32 = torch.float32
            parts = dict(
                temperature=torch.tensor([sp.temperature for sp in settings], device=dev, dtype=f32),
                top_k=torch.tensor([sp.top_k for sp in settings], device=dev),
                top_p=torch.tensor([sp.top_p for sp in settings], device=dev, dtype=f32),
                processed=torch.tensor([sp.logprobs_mode == "processed" for sp in settings], device=dev),
                stop_ids=torch.tensor([s + [-1] * (width - len(s)) for s in stops], dtype=torch.long, device=dev),
                budget=torch.tensor([sp.max_tokens for sp in settings], device=dev),
                count=torch.zeros(R, dtype=torch.long, device=dev),
                pos_next=lens_U.index_select(0, row_uniq),
                start=offset_U.index_select(0, row_uniq) + (c - P))
            if B == 0:
                for name, value in parts.items():
                    setattr(self, name, value)
                self.logits = logits
                self.cache_version = engine.version
                self.cache = KVCache(self.buf[:, :, :R], c) if self.can_join_running else target
            else:
                for name, value in parts.items():
                    setattr(self, name, _cat_padded(getattr(self, name), value))
                self.logits = torch.cat([self.logits, logits])
                self.cache = KVCache(self.buf[:, :, :B + R], c)
        self.rows = self.rows + new_rows
        self.logits_version = self.logits_version + [engine.version] * R
        for row in new_rows:
            self.requests.setdefault(row.request.key, row.request)
        self._settings_changed()

    def _prefix(self, uniq: list[tuple[int, ...]], uniq_lora: list[Resident | None]) -> SharedPrefix | None:
        """The keys and values of a prefix all distinct prompts share (each keeping >= 1 token
        of its own), one cache per owner among them (the base, each adapter), when using it
        saves work; None to prefill every prompt whole (always on the HF fallback or with a
        sliding window).
        - The engine's cached prefixes (inference/prefix_cache.py) of >= SHARED_PREFIX_MIN
          tokens, every owner's, are used at the shortest owner's length when recomputing the
          rest of the prompts' common prefix per prompt costs no more than computing it once
          per owner lacking it (a single prompt takes any such entry).
        - Else >= 2 prompts sharing >= SHARED_PREFIX_MIN tokens use that common prefix: an
          owner's cached entry at least that long, or one computed now in a row of its own,
          which the cache keeps for later prefills on the same weights."""
        engine = self.engine
        if not engine.share_prefix or not self.can_join_running or self.runner.sliding_window is not None:
            return None
        first, common = uniq[0], min(len(u) for u in uniq) - 1
        for u in uniq[1:]:
            common = next((i for i in range(common) if u[i] != first[i]), common)
        owner_U = [None if lora is None else lora.serial for lora in uniq_lora]  # each prompt's cache owner
        owners: dict[int | None, Resident | None] = {}  # owner key -> its adapter, first seen first
        for owner, lora in zip(owner_U, uniq_lora):
            owners.setdefault(owner, lora)
        cached = {o: engine.prefixes.longest(uniq, o) for o in owners}
        have = min(c.length if c is not None else 0 for c in cached.values())
        missing = sum(common for c in cached.values() if c is None or c.length < common)
        if have >= SHARED_PREFIX_MIN and (len(uniq) == 1 or len(uniq) * (common - have) <= missing):
            L, caches = have, cached
        elif len(uniq) >= 2 and common >= SHARED_PREFIX_MIN:
            L = common
            caches = {o: c if c is not None and c.length >= common else self._compute_prefix(first[:common], o, owners[o])
                      for o, c in cached.items()}
        else:
            return None
        reused = sum(caches[o] is cached[o] for o in owner_U)
        if reused:
            engine.prefixes.hits += 1
            engine.prefixes.tokens_reused += L * reused
        order = list(caches)
        rows_U = None if len(order) == 1 else torch.tensor([order.index(o) for o in owner_U], device=self.dev)
        return SharedPrefix([caches[o] for o in order], L, rows_U)  # type: ignore[misc]

    def _compute_prefix(self, tokens: tuple[int, ...], owner: int | None, adapter: Resident | None) -> KVCache:
        """The keys and values of `tokens` (positions 0..L-1) under `adapter` (None: the base),
        in a 1-row cache the engine's prefix cache keeps."""
        L = len(tokens)
        kv = self.runner.new_cache(1, L)
        self.runner.forward(torch.tensor([list(tokens)], device=self.dev), torch.arange(L, device=self.dev)[None],
                            kv, None, causal=True, **_lora(RowGroups([adapter], L, self.dev) if adapter else None))
        self.engine.prefixes.put(tokens, kv, owner)
        return kv

    def _prefill_on_prefix(self, uniq: list[tuple[int, ...]], uniq_lora: list[Resident | None],
                           prefix: SharedPrefix, P: int, pad: int, target: KVCache, row_uniq: torch.Tensor) -> torch.Tensor:
        """Prefill the U distinct prompts, which all start with the L tokens whose keys and
        values `prefix` holds (per owner), into `target` (R rows fanned out by row_uniq) exactly
        as one forward of them left-padded to P would: the U rests (S = P - L columns,
        left-padded, each with its adapter) attending to the prefix. A row's cache columns are
        [padding, prefix, its rest], the same layout as the plain prefill's, so decoding goes on
        unchanged. Returns the U last logits."""
        L = prefix.length
        dev, U, S = self.dev, len(uniq), P - L
        rest_U = torch.tensor([len(u) - L for u in uniq], device=dev)
        pad_U = S - rest_U  # left padding of each rest, and of each whole prompt in the cache
        tokens_U_S = torch.tensor([[pad] * (S - len(u) + L) + list(u[L:]) for u in uniq], device=dev)
        cols_S = torch.arange(S, device=dev)
        positions_U_S = L + (cols_S[None] - pad_U[:, None]).clamp_min(0)
        key_valid_U_T = torch.cat([torch.ones(U, L, dtype=torch.bool, device=dev), cols_S[None] >= pad_U[:, None]], 1)
        # cache column j of prompt u holds [prefix, rest] column: a pad's (j < pad), the prefix's, then the rest's
        j_P = torch.arange(P, device=dev)[None]
        layout_U_P = torch.where(j_P < pad_U[:, None], L + j_P,
                                 torch.where(j_P < pad_U[:, None] + L, j_P - pad_U[:, None], j_P))
        return self.runner.forward(tokens_U_S, positions_U_S, target, key_valid_U_T, causal=True,
                                   cache_rows=row_uniq, prefix=prefix, layout_B_T=layout_U_P,
                                   **_lora(RowGroups(uniq_lora, S, dev)))

    def _make_room(self, R: int, P: int, budget: int) -> int:
        """Ensure the buffer has R free rows and the columns a group of prompts up to P tokens
        and `budget` new tokens needs; returns the current column (where the group's prompts
        end). Reallocates (compacting the columns) only when it must."""
        buf, B, c = self.buf, len(self.rows), self.cache.length
        left = max(int((self.budget - self.count).max()), budget)
        if B + R <= buf.shape[2] and P <= c and c + left <= buf.shape[4]:
            return c
        origin = int(self.start.min())  # columns before it are seen by no live row: dropped
        c_new = max(c - origin, P)
        shift = c_new - c  # old column x -> x + shift
        columns = c_new + left
        columns += max(64, columns // 2)  # room for the next groups before the next reallocation
        rows = max(B + R, min(self.max_rows, 2 * (B + R)))
        shape = list(buf.shape)
        shape[2], shape[4] = rows, columns
        # uninitialised: every column a row can attend to is written or zeroed first (here for
        # the rows kept, in _prefill for a joining group)
        grown = buf.new_empty(shape)
        grown[:, :, :B, :, :origin + shift].zero_()
        grown[:, :, :B, :, origin + shift:c_new] = buf[:, :, :B, :, origin:c]
        self.buf = grown
        self.start = self.start + shift
        self.cache = KVCache(grown[:, :, :B], c_new)
        return c_new

    def _settings_changed(self) -> None:
        self.needs = Needs.of(self.temperature, self.top_k, self.top_p)
        differ = self.needs.scale or self.needs.filter  # processed logprobs differ from raw ones
        self.any_processed = differ and bool(self.processed.any())
        self.all_processed = self.any_processed and bool(self.processed.all())
        self.k_max = max(r.top for r in self.rows)
        self.any_strings = any(r.strings for r in self.rows)
        self.padded = bool((self.start > 0).any())
        self.lora = RowGroups([r.request.lora for r in self.rows], 1, self.dev)

    # ------------------------------------------------------------------ stepping

    def step(self, on_sampled: Callable[[StepOutput], None] | None = None) -> StepOutput:
        """Sample one token per live row, evict the rows that finished, run one forward for
        the rest (see the module doc). on_sampled(output) is called before that forward
        (a streaming client gets its token a forward sooner), `finished` still empty."""
        if not self.rows:
            return StepOutput([], [], [], [], [], [])
        engine = self.engine
        with engine.lock, torch.inference_mode():
            if self.recompute and self.cache_version != engine.version:
                self._recompute()
            out, tok, keep, finished = self._sample()
            if on_sampled is not None:
                on_sampled(out)
            if keep is None:  # every row finished
                self._drop_all()
            else:
                if len(keep) < len(self.rows):
                    tok = self._evict(keep, tok)
                key_valid = None
                if self.padded:
                    key_valid = torch.arange(self.cache.length + 1, device=self.dev)[None, :] >= self.start[:, None]
                self.logits = self.runner.forward(tok[:, None], self.pos_next[:, None], self.cache, key_valid,
                                                  causal=False, **_lora(self.lora))
                self.pos_next = self.pos_next + 1
                self.logits_version = [engine.version] * len(self.rows)
        out.finished = [(r.key, self._samples(r)) for r in finished]
        if not self.rows:
            self._release()
        return out

    def _recompute(self) -> None:
        """Rewrite every live row's keys and values, and its next-token logits, under the
        engine's current weights: one prefill of each row's prompt and tokens so far, into the
        cache columns the row already uses ([start, c), left-padded to the longest)."""
        dev, c = self.dev, self.cache.length
        seqs = [list(row.request.prompt) + row.tokens for row in self.rows]
        lens = torch.tensor([len(q) for q in seqs], device=dev)
        if not torch.equal(c - lens, self.start):
            raise RuntimeError("a row's tokens do not fill its cache columns: cannot recompute")
        L = int(lens.max())
        pad = 0 if self.engine.tokenizer.pad_token_id is None else self.engine.tokenizer.pad_token_id
        tokens_B_L = torch.tensor([[pad] * (L - len(q)) + q for q in seqs], device=dev)
        offset_B = L - lens
        positions_B_L = (torch.arange(L, device=dev)[None] - offset_B[:, None]).clamp_min(0)
        key_valid_B_L = torch.arange(L, device=dev)[None] >= offset_B[:, None] if bool((offset_B > 0).any()) else None
        target = KVCache(self.buf[:, :, :len(self.rows), :, c - L:], 0)
        self.logits = self.runner.forward(tokens_B_L, positions_B_L, target, key_valid_B_L, causal=True,
                                          **_lora(RowGroups([r.request.lora for r in self.rows], L, dev)))
        self.logits_version = [self.engine.version] * len(self.rows)
        self.cache_version = self.engine.version

    def _sample(self) -> tuple[StepOutput, torch.Tensor, list[int] | None, list[_Request]]:
        """Sample every row's token and record it; returns the step's output (`finished`
        empty), the tokens (B,), the rows that go on (None: none) and the requests done."""
        logits = self.logits
        tok, lp = sample_tokens(logits, self.temperature, self.top_k, self.top_p, self.generator,
                                processed_logprobs=self.all_processed, needs=self.needs)
        tops_ids = tops_lps = None
        if self.k_max:  # the token's logprob and its alternatives from one (B, V) table
            lp_B_V = reported_logprobs(logits, self.temperature, self.top_k, self.top_p, self.processed, self.needs)
            lp = lp_B_V.gather(-1, tok[:, None]).squeeze(-1)
            ids_B_K, lps_B_K = top_logprobs(lp_B_V, self.k_max, self.engine.known_tokens)
            tops_ids, tops_lps = ids_B_K.tolist(), lps_B_K.tolist()
        elif self.any_processed and not self.all_processed:
            lp = torch.where(self.processed,
                             processed_logprobs(logits, tok, self.temperature, self.top_k, self.top_p, self.needs), lp)
        self.count += 1
        hit_B = (tok[:, None] == self.stop_ids).any(-1)
        toks, lps, hit, done = tok.tolist(), lp.tolist(), hit_B.tolist(), (hit_B | (self.count >= self.budget)).tolist()
        versions = self.logits_version
        keys, indices, out_tok, out_lp, out_tops, out_versions = [], [], [], [], [], []
        keep: list[int] = []
        finished: list[_Request] = []
        for b, row in enumerate(self.rows):
            request = row.request
            if request.aborted:  # the caller went away: the row leaves, its token is dropped
                row.finish = ("cancelled", None)
            else:
                t = toks[b]
                row.tokens.append(t)
                row.logprobs.append(lps[b])
                pairs = top_pairs(tops_ids[b], tops_lps[b], row.top) if row.top else None
                if pairs is not None:
                    row.tops.append(pairs)
                if self.follow:
                    row.versions.append(versions[b])
                keys.append(request.key)
                indices.append(row.index)
                out_tok.append(t)
                out_lp.append(lps[b])
                out_tops.append(pairs)
                out_versions.append(versions[b])
                if done[b]:
                    row.finish = ("stop", t) if hit[b] else ("length", None)
                elif row.strings and (string := self.engine.stop_string_hit(row.tokens, row.strings)) is not None:
                    row.finish = ("string", string)
                else:
                    keep.append(b)
                    continue
            request.left -= 1
            if request.left == 0:
                finished.append(request)
        out = StepOutput(keys, indices, out_tok, out_lp, out_tops, out_versions)
        return out, tok, (keep or None), finished

    def _evict(self, keep: list[int], tok: torch.Tensor) -> torch.Tensor:
        """Keep rows `keep` (in the batch's row order); returns their tokens."""
        B = len(keep)
        if self.can_join_running:  # a row past the new end fills a hole left by a finished one
            order = list(range(B))
            holes = [b for b in range(B) if self.rows[b].finish is not None]
            movers = [b for b in keep if b >= B]
            for h, m in zip(holes, movers):
                order[h] = m
            if holes:
                self.buf[:, :, holes] = self.buf[:, :, movers]
            self.cache = KVCache(self.buf[:, :, :B], self.cache.length)
            idx = torch.tensor(order, device=self.dev)
        else:
            order = keep
            idx = torch.tensor(order, device=self.dev)
            self.cache = self.cache.select(idx)
        self.rows = [self.rows[b] for b in order]
        for name in self._ROW_TENSORS:
            setattr(self, name, getattr(self, name).index_select(0, idx))
        self._settings_changed()
        return tok.index_select(0, idx)

    def close(self) -> None:
        """Drop every row and request (after a failed step, or a caller that gives up)."""
        self._drop_all()
        self._release()

    def _drop_all(self) -> None:
        self.rows, self.cache, self.logits, self.buf = [], None, None, None
        self.logits_version = []

    def _release(self) -> None:
        """The batch drained: let a waiting weight update in, forget finished requests."""
        self.requests.clear()
        if self._pinned:
            self._pinned = False
            self.engine.unpin()

    def _samples(self, r: _Request) -> list[Sample]:
        """A finished request's samples, text decoded and cut at a stop string."""
        texts = self.engine.decode_rows([row.tokens for row in r.rows])
        samples = []
        for row, text in zip(r.rows, texts):
            reason, stop_reason = row.finish
            if reason == "string":
                reason = "stop"
                cut = text.find(stop_reason)
                text = text[:cut] if cut >= 0 else text
            version = row.versions[0] if row.versions else r.version
            samples.append(Sample(token_ids=row.tokens, logprobs=row.logprobs, finish_reason=reason, version=version,
                                  prompt_index=0, stop_reason=stop_reason, text=text, prompt_len=r.prompt_len,
                                  top_logprobs=row.tops if row.top else None,
                                  token_versions=row.versions if self.follow else None))
        self.requests.pop(r.key, None)
        return samples


def _cat_padded(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Rows of `old` then rows of `new`; 2-D tensors of different widths are padded with -1."""
    if old.dim() == 2 and old.shape[1] != new.shape[1]:
        width = max(old.shape[1], new.shape[1])
        old = torch.nn.functional.pad(old, (0, width - old.shape[1]), value=-1)
        new = torch.nn.functional.pad(new, (0, width - new.shape[1]), value=-1)
    return torch.cat([old, new])


def _lora(groups: RowGroups | None) -> dict:
    """The runner's `lora` argument when some row has an adapter (runners without LoRA rows
    need not take it)."""
    return {"lora": groups} if groups else {}
