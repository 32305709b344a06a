"""Load any local Hugging Face causal-LM folder, offline, with errors that say what is wrong."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever fetched from a hub
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # no "Loading weights" bars per load

# transformers and torch (seconds to import) are imported inside the functions that use them, in
# this package alone: its light parts (tool-call parsing, this module's folder rules) are imported
# by layers that load no model (the registry, the environments), which stay quick to import.


class ModelLoadError(ValueError):
    """A model folder is missing, is not a model, or holds an unsupported architecture."""


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt")  # where a vocabulary lives
_GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def quiet_transformers() -> None:
    """No per-load progress bars (set again at each use: something may have imported
    transformers before this module set HF_HUB_DISABLE_PROGRESS_BARS), and not peft's use of
    the attribute transformers 5 renamed (peft asks `is_gradient_checkpointing` of every model
    it wraps; transformers warns each time, about peft's code, not the user's)."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


def check_model_folder(path: str | Path) -> dict:
    """Return the folder's config.json as a dict, or raise ModelLoadError naming the problem.

    The one rule for "this folder is a model" (loading and the registry both ask it): a
    folder with a config.json that is a JSON object naming a causal-LM `model_type`
    transformers knows, and weights beside it (*.safetensors or *.bin).
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist (models load from local "
                             "folders only; build one with `flywheel model tiny --out DIR`)")
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is a file, not a model folder")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{str(path)!r} is not a model folder: it has no config.json")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{config_file}: invalid JSON at line {e.lineno}: {e.msg}") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_file} holds {type(config).__name__}, expected a JSON object")
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


def is_adapter_folder(path: str | Path) -> bool:
    """A peft adapter folder (adapter_config.json), not a whole model."""
    return (Path(path) / "adapter_config.json").is_file()


def same_model(a: str | Path, b: str | Path) -> bool:
    """Whether two model folders hold the same model: the same folder, or the same config.json
    and weight files that are the same files (hard links: a registry's linked copy) or equal in
    size and SHA-256."""
    a, b = Path(a).resolve(), Path(b).resolve()
    if a == b:
        return True
    try:
        if (a / "config.json").read_bytes() != (b / "config.json").read_bytes():
            return False
        weights = sorted(p.name for p in a.glob("*.safetensors"))
        if not weights or weights != sorted(p.name for p in b.glob("*.safetensors")):
            return False
        for name in weights:
            sa, sb = (a / name).stat(), (b / name).stat()
            if (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino):
                continue
            if sa.st_size != sb.st_size or _sha256(a / name) != _sha256(b / name):
                return False
    except OSError:
        return False
    return True


def _sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def check_servable_folder(path: str | Path) -> None:
    """A model folder (`check_model_folder`), or an adapter folder whose config names a base
    model folder that exists here and that has its weights; ModelLoadError otherwise."""
    if not is_adapter_folder(path):
        check_model_folder(path)
        return
    config_file = Path(path) / "adapter_config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{config_file}: invalid JSON at line {e.lineno}: {e.msg}") from None
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if not base or not Path(base).is_dir():
        raise ModelLoadError(f"{config_file}: base_model_name_or_path={base!r} is not a model folder here")
    if not any(Path(path).glob("adapter_model.*")):
        raise ModelLoadError(f"{str(path)!r} has an adapter config but no adapter weights (adapter_model.*)")


def load_tokenizer(path: str | Path):
    """The folder's tokenizer. A folder whose tokenizer_config.json names a generic fast
    tokenizer gets exactly its tokenizer.json pipeline: transformers 5's AutoTokenizer
    substitutes Qwen2Tokenizer (with NFC normalisation) for any qwen2 model, which would
    break the byte-level round trip of flywheel's tiny models."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    if not any((path / f).exists() for f in TOKENIZER_FILES):
        raise ModelLoadError(f"{str(path)!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    declared = None
    if (path / "tokenizer_config.json").exists():
        try:
            declared = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path / 'tokenizer_config.json'}: invalid JSON at line {e.lineno}: {e.msg}") from None
    if declared in _GENERIC_TOKENIZER_CLASSES and not (path / "tokenizer.json").exists():
        raise ModelLoadError(f"{str(path)!r}: tokenizer_config.json names {declared}, which is built from "
                             "tokenizer.json, and the folder has no tokenizer.json")
    cls = PreTrainedTokenizerFast if declared in _GENERIC_TOKENIZER_CLASSES else AutoTokenizer
    try:
        tok = cls.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types here; name the folder
        raise ModelLoadError(f"{str(path)!r}: cannot load a tokenizer: {e}") from e
    if len(tok.get_vocab()) <= len(tok.get_added_vocab()):  # only special tokens: nothing read the vocabulary
        absent = [f for f in VOCABULARY_FILES if not (path / f).exists()]
        raise ModelLoadError(f"{str(path)!r}: the tokenizer built from this folder has no vocabulary besides its "
                             f"{len(tok.get_added_vocab())} special tokens; its vocabulary file is missing "
                             f"(absent: {', '.join(absent)})")
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

    check_model_folder(path)
    quiet_transformers()
    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype, None)
    if dtype != "auto" and not (isinstance(torch_dtype, torch.dtype) and torch_dtype.is_floating_point):
        raise ModelLoadError(f"unknown dtype {dtype!r}; use float32, bfloat16, float16 or auto")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"{str(path)!r}: transformers could not load the model: {e}") from e
    tokenizer = load_tokenizer(path)
    check_vocabulary_fits(path, tokenizer, model.get_input_embeddings().weight.shape[0])
    return model.to(device).eval(), tokenizer


def check_vocabulary_fits(path: str | Path, tokenizer, embedding_rows: int) -> None:
    """ModelLoadError when the tokenizer makes ids the model cannot embed. A tokenizer smaller
    than the embedding is fine (padding rows, as the tiny models have)."""
    top = max(tokenizer.get_vocab().values()) + 1
    if top > embedding_rows:
        raise ModelLoadError(f"{str(path)!r}: the tokenizer makes ids up to {top - 1} but the model's embedding "
                             f"has {embedding_rows} rows; tokenizer and weights do not belong together")
