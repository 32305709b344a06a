"""The learner's forward through a model's own `forward`, for any causal LM transformers loads.

Every recipe (SFT, DPO, RL) gets its logits here, never by reaching into a model's modules
(`model.model`, `model.lm_head`, `model.transformer`): those names differ by family (GPT-2
keeps its decoder as `transformer`, Gemma soft-caps logits after the head), and only the
model's forward knows them all.

The lean part is the vocabulary projection: a (B, S, V) logits tensor costs B*S*V floats, so
where the model takes a boolean `logits_to_keep` (transformers >= 5, every family built on
`slice_logits_to_keep`) the head runs on the kept positions only; elsewhere every position is
projected and the kept ones are selected, with the same numbers.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable

import torch

from flywheel.train.losses import token_kl, token_nll_sum

_LOGITS_TO_KEEP_MASK: dict[type, bool] = {}  # model class -> takes a boolean logits_to_keep


def logits_at(model, keep: torch.Tensor, out: dict | None = None, **inputs) -> torch.Tensor:
    """(n, V) logits of `model(**inputs)` at the n True positions of keep (B, S), row-major.

    `out["cache"]` receives the returned KV cache. The first call for a model class finds out
    whether it takes the boolean mask; a caller that passes a cache in (SharedPrefixPlan's
    suffix forward) always comes after a call without one (its prefix forward), so a failed
    try never extends a cache."""
    cls = type(model)
    if _LOGITS_TO_KEEP_MASK.get(cls, True) and "logits_to_keep" in inspect.signature(model.forward).parameters:
        try:
            res = model(**inputs, logits_to_keep=keep)
            if res.logits.ndim == 2 and res.logits.shape[0] == int(keep.sum()):
                _LOGITS_TO_KEEP_MASK[cls] = True
                return _keep_cache(res, out).logits
        except torch.OutOfMemoryError:
            raise  # says nothing of the mask; the full projection would need more memory still
        except (IndexError, RuntimeError, TypeError, ValueError):
            pass
        _LOGITS_TO_KEEP_MASK[cls] = False
    res = model(**inputs)
    return _keep_cache(res, out).logits[keep]


def _keep_cache(res, out: dict | None):
    if out is not None:
        out["cache"] = getattr(res, "cache", None) or getattr(res, "past_key_values", None)
    return res


def set_learner_mode(model, dropout: bool) -> None:
    """Put the model in the mode its learner computes in: `dropout=False` is eval mode, so
    every dropout (modules, and the functional dropout attention applies when
    `module.training`) is off and the learner's logprobs are the sampler's; gradients flow
    all the same. RL and DPO compare logprobs with a sampler's or a reference's, so they
    always pass False; SFT follows `train.dropout`.

    Hugging Face checkpoints a layer only when that layer is in train mode
    (`GradientCheckpointingLayer`), so in eval mode `gradient_checkpointing_enable` alone would
    keep every activation. A layer with checkpointing on is therefore set to train mode on its
    own, not its children: its attention and MLP, where dropout lives, stay as `dropout` says."""
    model.train(dropout)
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) is True:
            module.training = True


def _predicting(target_mask_B_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(predict (B, T - 1), keep (B, T)): position t predicts token t + 1, so the positions kept
    are those whose next token is trained, target_mask[:, 1:], and never the last."""
    predict_B_Tm1 = target_mask_B_T[:, 1:].bool()
    return predict_B_Tm1, torch.cat([predict_B_Tm1, predict_B_Tm1.new_zeros(len(predict_B_Tm1), 1)], dim=1)


def sft_loss(model, input_ids_B_T: torch.Tensor, attention_mask_B_T: torch.Tensor,
             target_mask_B_T: torch.Tensor, normalizer: float) -> tuple[torch.Tensor, dict]:
    """Next-token loss on trained tokens only, divided by `normalizer` (the number of trained
    tokens in the whole optimizer step, so gradient accumulation gives a token mean).

    Position t predicts token t + 1, so the kept positions are keep[:, :-1] = target_mask[:, 1:];
    the model's own forward projects only those where it can (train/forward.py).
    """
    predict_B_Tm1, keep_B_T = _predicting(target_mask_B_T)
    targets_N = input_ids_B_T[:, 1:][predict_B_Tm1]
    logits_N_V = logits_at(model, keep_B_T, input_ids=input_ids_B_T, attention_mask=attention_mask_B_T,
                           use_cache=False)
    nll = token_nll_sum(logits_N_V, targets_N)
    n = int(targets_N.numel())
    return nll / normalizer, {"nll_sum": float(nll.detach()), "tokens": n}


def distill_loss(model, reference: Callable[[], contextlib.AbstractContextManager], input_ids_B_T: torch.Tensor,
                 attention_mask_B_T: torch.Tensor, target_mask_B_T: torch.Tensor,
                 normalizer: float) -> tuple[torch.Tensor, dict]:
    """The forward KL from the reference to the model at the trained positions, summed and
    divided by `normalizer`, as sft_loss's NLL: the soft-label version of imitating the
    reference's own text. The reference is `model` inside `reference()` (peft's
    `disable_adapter`: the model before its adapter), run without gradients."""
    predict_B_Tm1, keep_B_T = _predicting(target_mask_B_T)
    inputs = {"input_ids": input_ids_B_T, "attention_mask": attention_mask_B_T, "use_cache": False}
    with torch.no_grad(), reference():
        ref_N_V = logits_at(model, keep_B_T, **inputs)
    kl = token_kl(ref_N_V, logits_at(model, keep_B_T, **inputs)).sum()
    return kl / normalizer, {"kl_sum": float(kl.detach()), "tokens": int(predict_B_Tm1.sum())}
