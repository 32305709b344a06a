"""Fallback forward through Hugging Face's own model and DynamicCache, for any causal LM
the lean decoder does not cover. Same interface as LeanDecoder."""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache


class HFCache:
    def __init__(self, cache, length: int = 0):
        self.cache, self.length = cache, length

    def select(self, rows: torch.Tensor) -> "HFCache":
        self.cache.batch_select_indices(rows)
        return self


class HFRunner:
    def __init__(self, model):
        self.model = model
        self.device = next(model.parameters()).device
        params = inspect.signature(model.forward).parameters
        # transformers >= 5.2x renamed `past_key_values` to `cache`
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def new_cache(self, batch: int, capacity: int) -> HFCache:
        return HFCache(DynamicCache(config=self.model.config))

    @torch.inference_mode()
    def forward(self, tokens_B_S: torch.Tensor, positions_B_S: torch.Tensor, cache: HFCache,
                key_valid_B_T: torch.Tensor | None, causal: bool,
                cache_rows: torch.Tensor | None = None) -> torch.Tensor:
        B, S = tokens_B_S.shape
        if key_valid_B_T is None:
            key_valid_B_T = torch.ones(B, cache.length + S, dtype=torch.bool, device=self.device)
        out = self.model(input_ids=tokens_B_S, position_ids=positions_B_S,
                         attention_mask=key_valid_B_T.long(), use_cache=True,
                         **{self.cache_kwarg: cache.cache}, logits_to_keep=1)
        cache.length += S
        if cache_rows is not None:
            cache.select(cache_rows)
        return out.logits[:, -1].float()
