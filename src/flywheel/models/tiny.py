"""Tiny-model factory: a randomly initialised Qwen2 model with a byte-level tokenizer.

Everything in flywheel's tests and demos runs offline on a CPU, so we build models
locally instead of downloading them. The folder written here is a normal Hugging Face
model folder: `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`
load it, and `apply_chat_template(messages, tools=...)` renders the Hermes/Qwen
tool-call convention (see chat_template.jinja).

Tokenizer: byte-level BPE with no merges, so token id b (0 <= b < 256) is byte b and
every text has exactly one tokenization (re-encoding decoded text gives the same ids).
Special tokens follow the 256 byte ids. Load it with `flywheel.models.load_tokenizer`:
transformers 5's AutoTokenizer swaps in Qwen2Tokenizer for any qwen2 model, which adds NFC
normalisation (ASCII and NFC text are unaffected, other Unicode may re-encode differently).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from flywheel.models.loading import quiet_transformers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
N_BYTES = 256


@dataclass(frozen=True)
class TinySpec:
    """Shape of a tiny model. The defaults match ../shared/peers/trl_grpo_cpu (4.2M params)."""

    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int | None = None  # None: same as heads (no grouped-query attention)
    ffn: int = 1024
    max_positions: int = 4096
    seed: int = 0


def chat_template() -> str:
    return (Path(__file__).with_name("chat_template.jinja")).read_text()


def build_tokenizer():
    """A byte-level fast tokenizer: ids 0..255 are the bytes, then the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(N_BYTES)}
    assert set(vocab) == set(alphabet)
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=True))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token=IM_END,  # a chat model ends its turn with <|im_end|>
        pad_token=PAD,
        bos_token=None,
        unk_token=None,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = chat_template()
    tok.padding_side = "left"
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character map (used by ByteLevel)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def build_tiny_model(out: str | Path, spec: TinySpec = TinySpec()) -> Path:
    """Write a random-init Qwen2 model + byte-level tokenizer to `out`; return the path."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if spec.hidden % spec.heads:
        raise ValueError(f"hidden ({spec.hidden}) must be divisible by heads ({spec.heads})")
    kv_heads = spec.kv_heads or spec.heads
    if spec.heads % kv_heads:
        raise ValueError(f"heads ({spec.heads}) must be divisible by kv_heads ({kv_heads})")
    quiet_transformers()
    tok = build_tokenizer()
    vocab_size = _round_up(len(tok), 64)  # 259 used ids, padded for matmul-friendly shapes
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.ffn,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        pad_token_id=tok.pad_token_id,
        eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids(PAD)],
    )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    _template_into_tokenizer_config(out)
    info = {**spec.__dict__, "parameters": sum(p.numel() for p in model.parameters())}
    (out / "flywheel_tiny.json").write_text(json.dumps(info, indent=1) + "\n")
    return out


def _template_into_tokenizer_config(folder: Path) -> None:
    """Keep the chat template inside tokenizer_config.json, where every transformers
    version looks (v5 writes it to a separate chat_template.jinja by default), and name a
    tokenizer class that v4 knows too."""
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = chat_template()
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["padding_side"] = "left"  # batched generation pads on the left
    cfg_path.write_text(json.dumps(cfg, indent=1, ensure_ascii=False) + "\n")
    (folder / "chat_template.jinja").unlink(missing_ok=True)


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple
