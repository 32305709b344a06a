"""LocalEngine: batched sampling on torch (CPU or one GPU) with a KV cache.

One `generate` call runs the whole batch to completion:
  1. identical prompts are merged, the distinct ones left-padded and prefilled once;
  2. the cache and last logits are repeated for every sample of each prompt (`n` samples,
     and every request with the same prompt, share one prefill);
  3. decoding: each step samples one token per live row; rows that hit a stop token, a stop
     string or their token budget leave the batch (their cache rows are dropped), so
     finished rows cost nothing more.
Token ids and logprobs are gathered on the host after the loop. Weights are swapped between
calls by `update_weights`, guarded by a lock so a call never sees half an update.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields
from typing import Mapping, Sequence

import torch

from flywheel.inference.decoder import LeanDecoder, unsupported_reason
from flywheel.inference.hf_runner import HFRunner
from flywheel.inference.sampler import Sample, SamplingParams
from flywheel.inference.sampling import (Needs, filter_logits, reported_logprobs, sample_tokens, top_logprobs,
                                         top_pairs)


class LocalEngine:
    """A `Sampler` over a Hugging Face causal LM held in this process."""

    def __init__(self, model, tokenizer, version: int = 0, lean: bool | None = None,
                 seed: int | None = None, packed: bool | None = None):
        """model: a loaded HF causal LM (the engine takes it over: it is put in eval mode and
        its q/k/v and gate/up weights become views of fused tensors). lean: force (True) or
        forbid (False) the lean forward; None picks it when the architecture allows.
        packed: the lean forward's kernel set (inference/decoder.py; None picks by size)."""
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.version = version
        self.device = next(model.parameters()).device
        reason = unsupported_reason(model)
        if lean and reason:
            raise ValueError(f"lean forward unavailable: {reason}")
        self.runner = LeanDecoder(model, packed) if (lean is not False and reason is None) else HFRunner(model)
        self.eos_ids = _eos_ids(model, tokenizer)
        self.max_positions = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        # ids below it have a token; those past it (vocabulary padding rows) have none
        self.known_tokens = min(len(tokenizer), self.vocab_size)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed if seed is not None else torch.initial_seed() % (1 << 62))
        self._lock = threading.Lock()
        self._params = dict(model.named_parameters(remove_duplicate=False))
        self._unique_params = dict(model.named_parameters())  # tied weights once: what a learner publishes

    @classmethod
    def from_path(cls, path: str, dtype: str = "float32", device: str = "cpu", **kw) -> "LocalEngine":
        from flywheel.models import load

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
        with self._lock, torch.no_grad():
            for name, t in items.items():
                self._params[name].copy_(t)
            if hasattr(self.runner, "refresh"):
                self.runner.refresh()  # packed kernel weights are copies
            self.version = int(version)

    def receive(self, transport) -> bool:
        """Load `transport`'s newest weights (a flywheel.weights.WeightTransport) when they are
        newer than ours; True if they were. The copy happens under the lock, so a concurrent
        `generate` sees the old weights or the new ones, never a mix."""
        if transport.version() <= self.version:
            return False
        with self._lock, torch.no_grad():
            version = transport.read_into(self._unique_params)
            if hasattr(self.runner, "refresh"):
                self.runner.refresh()
            self.version = int(version)
        return True

    def state_names(self) -> list[str]:
        return list(self._params)

    # ------------------------------------------------------------------ text helpers

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def generate_text(self, prompts: Sequence[str], params: SamplingParams) -> list[list[Sample]]:
        return self.generate([self.encode(p) for p in prompts], params)

    # ------------------------------------------------------------------ sampling

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[list[Sample]]:
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        vocab = self.vocab_size
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            lo, hi = min(p), max(p)
            if lo < 0 or hi >= vocab:
                raise ValueError(f"prompt {i} has token id {lo if lo < 0 else hi}, outside the "
                                 f"model's vocabulary [0, {vocab})")
            if len(p) + sp.max_tokens > self.max_positions:
                raise ValueError(f"prompt {i}: {len(p)} tokens + max_tokens {sp.max_tokens} exceeds "
                                 f"the model's {self.max_positions} positions")
        if not prompts:
            return []
        with self._lock:
            return self._generate(prompts, params)

    def _generate(self, prompts, params) -> list[list[Sample]]:
        dev = self.device
        # ---- distinct prompts, left-padded
        unique: dict[tuple[int, ...], int] = {}
        for p in prompts:
            unique.setdefault(tuple(p), len(unique))
        uniq = list(unique)
        lens = [len(u) for u in uniq]
        P = max(lens)
        pad = 0 if self.tokenizer.pad_token_id is None else self.tokenizer.pad_token_id
        tokens_U_P = torch.tensor([[pad] * (P - len(u)) + list(u) for u in uniq], device=dev)
        lens_U = torch.tensor(lens, device=dev)
        offset_U = P - lens_U
        positions_U_P = (torch.arange(P, device=dev)[None] - offset_U[:, None]).clamp_min(0)
        padded = min(lens) < P
        key_valid_U_P = (positions_U_P > 0) | (torch.arange(P, device=dev)[None] == offset_U[:, None]) \
            if padded else None

        # ---- one row per sample: (prompt index, sample index); per-row settings built per
        # distinct SamplingParams object, then repeated
        rows = [(i, j) for i, sp in enumerate(params) for j in range(sp.n)]
        R = len(rows)
        row_uniq = torch.tensor([unique[tuple(prompts[i])] for i, _ in rows], device=dev)
        row_params = [params[i] for i, _ in rows]
        settings = {}
        for sp in params:
            if id(sp) not in settings:
                stops = sorted(set(sp.stop_token_ids) | (set() if sp.ignore_eos else self.eos_ids))
                settings[id(sp)] = (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens, stops)
        per_row = [settings[id(sp)] for sp in row_params]
        temperature = torch.tensor([x[0] for x in per_row], device=dev, dtype=torch.float32)
        top_p = torch.tensor([x[1] for x in per_row], device=dev, dtype=torch.float32)
        top_k = torch.tensor([x[2] for x in per_row], device=dev)
        max_new = torch.tensor([x[3] for x in per_row], device=dev)
        width = max(1, max(len(x[4]) for x in settings.values()))
        stop_ids = torch.tensor([x[4] + [-1] * (width - len(x[4])) for x in per_row], dtype=torch.long, device=dev)
        processed = [sp.logprobs_mode == "processed" for sp in row_params]
        string_rows = {r for r, sp in enumerate(row_params) if sp.stop}
        T_new = max(x[3] for x in settings.values())
        needs = Needs.of(temperature, top_k, top_p)  # for the whole call: rows only ever leave
        # processed logprobs differ from raw ones only under a temperature other than 0 / 1 or a filter
        differ = needs.scale or needs.filter
        all_processed = differ and all(processed)
        mixed_processed = differ and any(processed) and not all_processed
        k_max = max(sp.top_logprobs for sp in row_params)  # alternatives per token (0: none)
        known = self.known_tokens

        # ---- prefill the distinct prompts once, then fan out
        cache = self.runner.new_cache(R, P + T_new)
        logits = self.runner.forward(tokens_U_P, positions_U_P, cache, key_valid_U_P, causal=True,
                                     cache_rows=row_uniq).index_select(0, row_uniq)
        key_valid = key_valid_U_P.index_select(0, row_uniq) if padded else None

        out_tok = torch.zeros(R, T_new, dtype=torch.long, device=dev)
        out_lp = torch.zeros(R, T_new, dtype=torch.float32, device=dev)
        n_out = torch.zeros(R, dtype=torch.long, device=dev)  # tokens kept per row
        if k_max:
            K = min(k_max, known)
            out_top_ids = torch.zeros(R, T_new, K, dtype=torch.long, device=dev)  # (R, T, K)
            out_top_lp = torch.full((R, T_new, K), float("-inf"), device=dev)  # (R, T, K)
        hit_token = torch.zeros(R, dtype=torch.bool, device=dev)  # ended by a stop token
        hit_string: dict[int, str] = {}
        live = _LiveRows(idx=torch.arange(R, device=dev), temperature=temperature, top_k=top_k, top_p=top_p,
                         max_new=max_new, stop_ids=stop_ids, pos_next=lens_U.index_select(0, row_uniq),
                         processed=torch.tensor(processed, device=dev),
                         key_valid=None if not padded else torch.cat(
                             [key_valid_U_P.index_select(0, row_uniq),
                              torch.ones(R, T_new, dtype=torch.bool, device=dev)], 1))
        gen_text_ids: dict[int, list[int]] = {r: [] for r in string_rows}
        t = 0
        while True:
            tok, lp = sample_tokens(logits, live.temperature, live.top_k, live.top_p, self.generator,
                                    processed_logprobs=all_processed, needs=needs)
            if k_max:  # the token's logprob and its alternatives from one (B, V) table
                lp_B_V = reported_logprobs(logits, live.temperature, live.top_k, live.top_p, live.processed, needs)
                lp = lp_B_V.gather(-1, tok[:, None]).squeeze(-1)
                out_top_ids[live.idx, t], out_top_lp[live.idx, t] = top_logprobs(lp_B_V, K, known)
            elif mixed_processed:
                lp = torch.where(live.processed, _processed_logprobs(logits, tok, live, needs), lp)
            out_tok[live.idx, t] = tok
            out_lp[live.idx, t] = lp
            t += 1
            hit = (tok[:, None] == live.stop_ids).any(-1)
            done = hit | (live.max_new <= t)
            if string_rows:
                self._check_stop_strings(live, tok, done, gen_text_ids, string_rows, row_params, hit_string)
            if bool(done.any()):
                n_out[live.idx[done]] = t
                hit_token[live.idx[hit]] = True
                if bool(done.all()):
                    break
                keep = (~done).nonzero().squeeze(1)
                live, tok, cache = live.select(keep), tok.index_select(0, keep), cache.select(keep)
            key_valid = None if live.key_valid is None else live.key_valid[:, :P + t]
            logits = self.runner.forward(tok[:, None], live.pos_next[:, None], cache, key_valid, causal=False)
            live.pos_next = live.pos_next + 1

        # ---- gather results on the host
        lengths = n_out.tolist()
        ids_per_row = [row[:n] for row, n in zip(out_tok.cpu().tolist(), lengths)]
        lps_per_row = [row[:n] for row, n in zip(out_lp.cpu().tolist(), lengths)]
        texts = self._decode_batch(ids_per_row)
        hits = hit_token.tolist()
        if k_max:
            top_ids, top_lps = out_top_ids.cpu().tolist(), out_top_lp.cpu().tolist()
        results: list[list[Sample]] = [[] for _ in prompts]
        for r, (i, _) in enumerate(rows):
            ids, text = ids_per_row[r], texts[r]
            if r in hit_string:
                reason, stop_reason = "stop", hit_string[r]
                cut = text.find(stop_reason)
                text = text[:cut] if cut >= 0 else text
            elif hits[r]:
                reason, stop_reason = "stop", ids[-1]
            else:
                reason, stop_reason = "length", None
            k = row_params[r].top_logprobs
            tops = [top_pairs(a, b, k) for a, b in zip(top_ids[r][:len(ids)], top_lps[r][:len(ids)])] if k else None
            results[i].append(Sample(token_ids=ids, logprobs=lps_per_row[r], finish_reason=reason,
                                     version=self.version, prompt_index=i, stop_reason=stop_reason,
                                     text=text, prompt_len=len(prompts[i]), top_logprobs=tops))
        return results

    def _decode_batch(self, ids: list[list[int]]) -> list[str]:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            # row by row in this thread: decode_batch hands rows to a thread pool, which fights
            # torch's still-spinning OpenMP workers for the cores (2 ms instead of 0.05 ms)
            return [backend.decode(row, skip_special_tokens=True) for row in ids]
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)

    def _check_stop_strings(self, live, tok, done, gen_text_ids, string_rows, row_params, hit_string) -> None:
        """Mark rows whose text now contains one of their stop strings (updates `done`)."""
        for b, (r, token) in enumerate(zip(live.idx.tolist(), tok.tolist())):
            if r in string_rows and not bool(done[b]):
                ids = gen_text_ids[r]
                ids.append(token)
                matched = self._stop_string_hit(ids, row_params[r].stop)
                if matched is not None:
                    hit_string[r] = matched
                    done[b] = True

    def _stop_string_hit(self, ids: list[int], stops: tuple[str, ...]) -> str | None:
        # a stop string of c characters spans at most 4c byte-level tokens (UTF-8)
        window = 4 * max(len(s) for s in stops) + 4
        text = self.tokenizer.decode(ids[-window:], skip_special_tokens=False)
        for s in stops:
            if s in text:
                return s
        return None


def _processed_logprobs(logits, tok, live: "_LiveRows", needs: Needs) -> torch.Tensor:
    """log-probability of `tok` under each row's filtered sampling distribution."""
    filtered = filter_logits(logits.float(), live.temperature, live.top_k, live.top_p, needs)
    base = torch.where((live.temperature <= 0)[:, None], logits.float(), filtered)
    return base.log_softmax(-1).gather(-1, tok[:, None]).squeeze(-1)


@dataclass
class _LiveRows:
    """Per-row state of the rows still generating, aligned with the batch (B,)."""

    idx: torch.Tensor  # original row index
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    max_new: torch.Tensor
    stop_ids: torch.Tensor  # (B, W) stop token ids, -1 padded
    pos_next: torch.Tensor  # position of the next token fed in
    processed: torch.Tensor  # logprobs_mode == "processed"
    key_valid: torch.Tensor | None  # (B, P + T_new) False on left padding; None without padding

    def select(self, keep: torch.Tensor) -> "_LiveRows":
        return _LiveRows(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).index_select(0, keep)
                            for f in fields(self)})


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
