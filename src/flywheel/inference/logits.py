"""Pure math on a batch of next-token logits (B, V): temperature, top-k, top-p, sampling,
the logprobs each row reports and its top alternatives."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Needs:
    """Which steps any row of a batch needs, so the common cases skip the rest."""

    scale: bool = True  # some row has a temperature other than 0 and 1
    filter: bool = True  # some row uses top-k or top-p
    greedy: bool = True  # some row is greedy (temperature 0)
    sample: bool = True  # some row samples

    @staticmethod
    def of(temperature_B: torch.Tensor, top_k_B: torch.Tensor, top_p_B: torch.Tensor) -> "Needs":
        greedy = temperature_B <= 0
        return Needs(scale=bool(((temperature_B != 1) & ~greedy).any()),
                     filter=bool((top_k_B > 0).any() or (top_p_B < 1).any()),
                     greedy=bool(greedy.any()), sample=bool((~greedy).any()))


def filter_logits(logits_B_V: torch.Tensor, temperature_B: torch.Tensor, top_k_B: torch.Tensor,
                  top_p_B: torch.Tensor, needs: Needs | None = None) -> torch.Tensor:
    """Scaled, filtered logits: logits / temperature, then -inf outside each row's top-k
    (k=0: off) and outside the smallest set of tokens whose probability reaches top_p.
    The most likely token always survives. Rows with temperature 0 are scaled by 1."""
    needs = needs or Needs.of(temperature_B, top_k_B, top_p_B)
    scaled = logits_B_V
    if needs.scale:
        temp = torch.where(temperature_B > 0, temperature_B, torch.ones_like(temperature_B))
        scaled = logits_B_V / temp[:, None]
    if not needs.filter:
        return scaled
    sorted_B_V, order_B_V = scaled.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_B_V, dtype=torch.bool)
    rank = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
    drop |= (top_k_B[:, None] > 0) & (rank >= top_k_B[:, None])
    probs = sorted_B_V.masked_fill(drop, float("-inf")).softmax(-1)
    mass_before = probs.cumsum(-1) - probs  # probability of strictly better tokens
    drop |= mass_before >= top_p_B[:, None]
    drop[:, 0] = False
    sorted_B_V = sorted_B_V.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order_B_V, sorted_B_V)


def sample_tokens(logits_B_V: torch.Tensor, temperature_B: torch.Tensor, top_k_B: torch.Tensor,
                  top_p_B: torch.Tensor, generator: torch.Generator | None = None,
                  processed_logprobs: bool = False, needs: Needs | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. Returns (tokens_B, logprobs_B).

    Greedy (argmax of the raw logits) where temperature is 0; elsewhere the Gumbel-max
    trick on the filtered logits, which draws exactly from their softmax. logprobs are of
    the raw temperature-1 distribution, or of the filtered one if `processed_logprobs`
    (greedy rows: the raw one). `needs` (computed when None) lets a caller that knows its
    batch skip unused steps.
    """
    logits_B_V = logits_B_V.float()
    needs = needs or Needs.of(temperature_B, top_k_B, top_p_B)
    greedy_B = temperature_B <= 0
    filtered = filter_logits(logits_B_V, temperature_B, top_k_B, top_p_B, needs) \
        if (needs.sample or processed_logprobs) else logits_B_V
    if not needs.sample:
        tokens = logits_B_V.argmax(-1)
    else:
        # Gumbel-max: -log(-log U) is Gumbel(0, 1); torch.rand is ~3x cheaper than exponential_
        gumbel = torch.rand(filtered.shape, generator=generator, device=filtered.device).log_().neg_().log_().neg_()
        tokens = (filtered + gumbel).argmax(-1)
        if needs.greedy:
            tokens = torch.where(greedy_B, logits_B_V.argmax(-1), tokens)
    base = logits_B_V
    if processed_logprobs:
        base = torch.where(greedy_B[:, None], logits_B_V, filtered) if needs.greedy else filtered
    logprobs = base.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs


def reported_logprobs(logits_B_V: torch.Tensor, temperature_B: torch.Tensor, top_k_B: torch.Tensor,
                      top_p_B: torch.Tensor, processed_B: torch.Tensor, needs: Needs | None = None) -> torch.Tensor:
    """(B, V) the log-probabilities each row reports, for its sampled token and its top
    alternatives alike: the filtered sampling distribution (`filter_logits`) for processed
    rows that sample, the raw temperature-1 one for the others (raw rows, greedy rows)."""
    raw = logits_B_V.float()
    needs = needs or Needs.of(temperature_B, top_k_B, top_p_B)
    base = raw
    if bool(processed_B.any()) and (needs.scale or needs.filter):
        filtered = filter_logits(raw, temperature_B, top_k_B, top_p_B, needs)
        base = torch.where((processed_B & (temperature_B > 0))[:, None], filtered, raw)
    return base.log_softmax(-1)


def top_logprobs(logprobs_B_V: torch.Tensor, k: int, known: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_B_K, logprobs_B_K): each row's k most likely ids, best first, among ids < known
    (the tokenizer's; None: all). Entries past a filtered row's support are -inf."""
    lp = logprobs_B_V if known is None else logprobs_B_V[:, :known]
    values, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)  # sorted, descending
    return ids, values


def top_pairs(ids_K: list[int], logprobs_K: list[float], k: int) -> list[tuple[int, float]]:
    """One token's first k alternatives as (id, logprob) pairs, those of probability 0 left out."""
    return [(i, lp) for i, lp in zip(ids_K[:k], logprobs_K[:k]) if lp != float("-inf")]


def processed_logprobs(logits_B_V: torch.Tensor, tokens_B: torch.Tensor, temperature_B: torch.Tensor,
                       top_k_B: torch.Tensor, top_p_B: torch.Tensor, needs: Needs | None = None) -> torch.Tensor:
    """(B,) log-probability of each row's token under its filtered sampling distribution
    (greedy rows: the raw temperature-1 one)."""
    raw = logits_B_V.float()
    filtered = filter_logits(raw, temperature_B, top_k_B, top_p_B, needs)
    base = torch.where((temperature_B <= 0)[:, None], raw, filtered)
    return base.log_softmax(-1).gather(-1, tokens_B[:, None]).squeeze(-1)
