"""LoRA training through peft: the model a recipe trains when `train.lora` is set.

`load_trainable(path, lora, ...)`:
- `lora` None and `path` a model folder: the model, every weight trained (as before);
- `lora` set and `path` a model folder: that model with a fresh adapter (peft's init: A
  random, B zero, so step 0 is the base model exactly); only the adapter trains;
- `path` an adapter folder (a LoRA checkpoint, or a fine-tuned adapter to continue): its
  base (adapter_config.json's `base_model_name_or_path`) with that adapter, trainable. The
  adapter's own rank and targets hold; `lora`, if given, must agree with them.

A PeftModel's `save_pretrained` writes the adapter alone (adapter_config.json,
adapter_model.safetensors), so checkpoints and the final model of a LoRA run are adapter
folders: a few MB, loadable by peft onto the base as they are, and by the engine's
AdapterPool (inference/adapters.py). `merged_folder` writes base + adapter as one plain model.

RL's rollout engines run the learner's current policy as plain weights: `MergedWeights` keeps
W + scaling * B A per adapted projection, refreshed at each publish, under the plain model's
names (the learner trains the adapter; the engines never see peft).
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from flywheel.config import LoraSettings
from flywheel.inference.lora import AdapterError, adapter_base, is_adapter_folder
from flywheel.models import load

_MERGING = threading.Lock()


def peft_config(lora: LoraSettings):
    from peft import LoraConfig

    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.targets),
                      bias="none")


def load_trainable(path: str | Path, lora: LoraSettings | None, *, dtype: str, device: str):
    """(model, tokenizer) to train: see the module doc."""
    from peft import PeftModel, get_peft_model

    if not is_adapter_folder(path):
        model, tokenizer = load(str(path), dtype=dtype, device=device)
        if lora is None:
            return model, tokenizer
        model.name_or_path = str(Path(path).resolve())  # what the adapter's config names as its base
        return get_peft_model(model, peft_config(lora)), tokenizer
    base, tokenizer = load(adapter_base(path), dtype=dtype, device=device)
    model = PeftModel.from_pretrained(base, str(path), is_trainable=True)
    if lora is not None:
        saved = model.peft_config["default"]
        if saved.r != lora.rank or set(saved.target_modules) != set(lora.targets):
            raise AdapterError(f"{path}: the adapter has rank {saved.r} on {sorted(saved.target_modules)}; "
                            f"train.lora asks rank {lora.rank} on {sorted(lora.targets)}")
    return model, tokenizer


def trainable_count(model) -> tuple[int, int]:
    """(trained parameters, all parameters)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def merged_folder(adapter: str | Path, dest: str | Path, *, dtype: str = "float32") -> Path:
    """Write the adapter's base with the adapter merged in, as a plain model folder."""
    from peft import PeftModel

    from flywheel.train.checkpoint import save_model_folder

    base, tokenizer = load(adapter_base(adapter), dtype=dtype, device="cpu")
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    save_model_folder(merged, tokenizer, Path(dest))
    return Path(dest)


def merged_copy(adapter: str | Path) -> Path:
    """`merged_folder` of the adapter, written once beside it (`<folder>.merged`) and reused."""
    adapter = Path(adapter)
    dest = adapter.with_name(adapter.name + ".merged")
    with _MERGING:
        if not (dest / "config.json").is_file():
            merged_folder(adapter, dest)
    return dest


def whole_model(path: str | Path) -> Path:
    """A folder that loads as a whole model: `path` itself, or for a LoRA adapter its
    `merged_copy`."""
    return merged_copy(path) if is_adapter_folder(path) else Path(path)


def is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


class MergedWeights:
    """What a rollout engine runs for a LoRA learner: the plain model's parameter names ->
    tensors, each adapted projection W + scaling * B A in a buffer of its own, every other
    weight the learner's tensor as it is (not copied). `refresh()` recomputes the buffers from
    the adapter's current values (no grad) and returns the dict, whose keys and shapes are
    those of `load(base).named_parameters()`, so the weight transports and engines take it as
    they take a full learner's parameters."""

    def __init__(self, peft_model, adapter: str = "default"):
        from peft.tuners.lora import LoraLayer

        self.adapter = adapter
        inner = peft_model.get_base_model()  # the transformers model, LoRA layers injected
        self._adapted: list[tuple[torch.Tensor, object]] = []  # (buffer, LoRA layer)
        self.weights: dict[str, torch.Tensor] = {}
        lora_layers = {f"{name}.base_layer.weight": m for name, m in inner.named_modules() if isinstance(m, LoraLayer)}
        for name, param in inner.named_parameters():
            if ".lora_" in name:
                continue
            plain = name.replace(".base_layer.", ".")
            layer = lora_layers.get(name)
            if layer is None:
                self.weights[plain] = param
                continue
            if layer.use_dora.get(adapter) or getattr(layer, "fan_in_fan_out", False):
                raise AdapterError(f"{plain}: DoRA / fan_in_fan_out adapters are not merged for rollouts")
            buffer = torch.empty_like(param, requires_grad=False)
            self._adapted.append((buffer, layer))
            self.weights[plain] = buffer
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> dict[str, torch.Tensor]:
        for buffer, layer in self._adapted:
            a, b = layer.lora_A[self.adapter].weight, layer.lora_B[self.adapter].weight  # (r, in), (out, r)
            buffer.copy_(layer.base_layer.weight).addmm_(b, a, alpha=layer.scaling[self.adapter])
        return self.weights


def merged_model(peft_model):
    """A plain model (own copy) with the adapter merged in: what an engine is built on."""
    import copy

    return copy.deepcopy(peft_model).merge_and_unload()
