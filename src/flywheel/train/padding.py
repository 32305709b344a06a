"""Padding for token-level training batches."""

from __future__ import annotations

import torch


def pad_batch(seqs: list[list[int]], masks: list[list[int]], pad_id: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad to the longest sequence. Returns input_ids (B, T), attention_mask (B, T)
    and target_mask (B, T): target_mask[b, t] = 1 where token t is trained."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), T), dtype=torch.long)
    tmask = torch.zeros((len(seqs), T), dtype=torch.long)
    for b, (s, m) in enumerate(zip(seqs, masks)):
        ids[b, :len(s)] = torch.tensor(s)
        attn[b, :len(s)] = 1
        tmask[b, :len(m)] = torch.tensor(m)
    return ids, attn, tmask
