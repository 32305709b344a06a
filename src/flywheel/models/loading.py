"""Load any local Hugging Face causal-LM folder, offline, with errors that say what is wrong."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever fetched from a hub
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no "Loading weights" bars per load


class ModelLoadError(ValueError):
    """A model folder is missing, is not a model, or holds an unsupported architecture."""


def check_model_folder(path: str | Path) -> dict:
    """Return the folder's config.json as a dict, or raise ModelLoadError naming the problem."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist (models load from local "
                             "folders only; build one with `flywheel model tiny --out DIR`)")
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is a file, not a model folder")
    config_file = path / "config.json"
    if not config_file.exists():
        raise ModelLoadError(f"{str(path)!r} is not a model folder: it has no config.json")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{config_file}: invalid JSON at line {e.lineno}: {e.msg}") from None
    if "model_type" not in config:
        raise ModelLoadError(f"{config_file} has no 'model_type'; it is not a transformers model config")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config["model_type"] not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelLoadError(
            f"{str(path)!r}: model_type {config['model_type']!r} is not a causal language model "
            f"that transformers can load (supported include: llama, mistral, qwen2, qwen3, gemma, phi...)")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ModelLoadError(f"{str(path)!r} has a config but no weights (*.safetensors or *.bin)")
    return config


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types here; name the folder
        raise ModelLoadError(f"{str(path)!r}: cannot load a tokenizer: {e}") from e
    if tok.pad_token_id is None:  # batching needs a pad id; reuse eos as most recipes do
        tok.pad_token = tok.eos_token
    return tok


def load(path: str | Path, dtype: str = "float32", device: str = "cpu"):
    """Load `(model, tokenizer)` from a local Hugging Face causal-LM folder.

    dtype: "float32" | "bfloat16" | "float16" | "auto" (as saved). The model is returned in
    eval mode on `device`.
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    check_model_folder(path)
    hf_logging.disable_progress_bar()
    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype, None)
    if torch_dtype is None:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use float32, bfloat16, float16 or auto")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"{str(path)!r}: transformers could not load the model: {e}") from e
    tokenizer = load_tokenizer(path)
    return model.to(device).eval(), tokenizer
