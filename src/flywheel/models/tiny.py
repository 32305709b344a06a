"""Tiny-model factory: a randomly initialised causal LM with a byte-level tokenizer.

The default architecture is Qwen2; `TinySpec.arch` builds the same shape as Llama, Mistral,
Qwen3, GPT-2, GPT-NeoX, Phi or Gemma instead (each keeps its family's defaults, GPT-2's 0.1
dropout included), so the recipes are tested on families whose module layouts differ.

Everything in flywheel's tests and demos runs offline on a CPU, so we build models
locally instead of downloading them. The folder written here is a normal Hugging Face
model folder: `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`
load it, and `apply_chat_template(messages, tools=...)` renders the Hermes/Qwen
tool-call convention (see chat_template.jinja). `TinySpec.template` picks the chat template:
"hermes" (chat_template.jinja: the tool schemas as JSON, about 650 byte tokens for one tool)
or "compact" (chat_template_compact.jinja: one signature line per tool, otherwise the same
text), for a model trained on tool-offering prompts within a small budget.

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

from tokenizers import Tokenizer, decoders, models as tokenizer_models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

from flywheel.models.loading import quiet_transformers
from flywheel.models.token_bytes import bytes_to_unicode

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
    arch: str = "qwen2"  # one of ARCHITECTURES
    template: str = "hermes"  # the chat template, one of TEMPLATES


TEMPLATES = {"hermes": "chat_template.jinja", "compact": "chat_template_compact.jinja"}


def chat_template(name: str = "hermes") -> str:
    """The text of chat template `name` (a key of TEMPLATES)."""
    if name not in TEMPLATES:
        raise ValueError(f"template {name!r} is not one of {', '.join(TEMPLATES)}")
    return (Path(__file__).with_name(TEMPLATES[name])).read_text()


def build_tokenizer(template: str = "hermes"):
    """A byte-level fast tokenizer: ids 0..255 are the bytes, then the special tokens; its
    chat template is TEMPLATES[template]."""
    from transformers import PreTrainedTokenizerFast  # lazy: see loading.py

    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    byte_to_char = bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(N_BYTES)}
    assert set(vocab) == set(alphabet)
    raw = Tokenizer(tokenizer_models.BPE(vocab=vocab, merges=[], ignore_merges=True))
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
    tok.chat_template = chat_template(template)
    tok.padding_side = "left"
    return tok


def build_tiny_model(out: str | Path, spec: TinySpec = TinySpec()) -> Path:
    """Write a random-init model of `spec.arch` + byte-level tokenizer to `out`; return the path."""
    import torch  # lazy: see loading.py
    from transformers import AutoModelForCausalLM, GenerationConfig

    if spec.arch not in ARCHITECTURES:
        raise ValueError(f"arch {spec.arch!r} is not one of {', '.join(ARCHITECTURES)}")
    template = chat_template(spec.template)  # an unknown name fails before anything is built
    if spec.hidden % spec.heads:
        raise ValueError(f"hidden ({spec.hidden}) must be divisible by heads ({spec.heads})")
    kv_heads = spec.kv_heads or spec.heads
    if spec.heads % kv_heads:
        raise ValueError(f"heads ({spec.heads}) must be divisible by kv_heads ({kv_heads})")
    quiet_transformers()
    tok = build_tokenizer(spec.template)
    vocab_size = _round_up(len(tok), 64)  # 259 used ids, padded for matmul-friendly shapes
    config = _config(spec, kv_heads, vocab_size, tok.pad_token_id, tok.eos_token_id)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(
        pad_token_id=tok.pad_token_id,
        eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids(PAD)],
    )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    _template_into_tokenizer_config(out, template)
    info = {**spec.__dict__, "parameters": sum(p.numel() for p in model.parameters())}
    (out / "flywheel_tiny.json").write_text(json.dumps(info, indent=1) + "\n")
    return out


ARCHITECTURES = ("qwen2", "llama", "mistral", "qwen3", "gpt2", "gpt_neox", "phi", "gemma")


def _config(spec: TinySpec, kv_heads: int, vocab_size: int, pad_id: int, eos_id: int):
    import transformers  # lazy: see loading.py

    common = dict(vocab_size=vocab_size, pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=None,
                  tie_word_embeddings=True, dtype="float32")
    if spec.arch == "gpt2":  # GPT-2 names its fields n_*; no grouped-query attention
        return transformers.GPT2Config(n_embd=spec.hidden, n_layer=spec.layers, n_head=spec.heads,
                                       n_inner=spec.ffn, n_positions=spec.max_positions, **common)
    shape = dict(hidden_size=spec.hidden, intermediate_size=spec.ffn, num_hidden_layers=spec.layers,
                 num_attention_heads=spec.heads, max_position_embeddings=spec.max_positions)
    if spec.arch == "gpt_neox":  # no grouped-query attention; partial rotary (rotary_pct 0.25)
        return transformers.GPTNeoXConfig(**shape, **common)
    shape["num_key_value_heads"] = kv_heads
    cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig,
           "mistral": transformers.MistralConfig, "qwen3": transformers.Qwen3Config,
           "phi": transformers.PhiConfig, "gemma": transformers.GemmaConfig}[spec.arch]
    if spec.arch in ("qwen3", "gemma"):  # their default head_dim is not hidden / heads
        shape["head_dim"] = spec.hidden // spec.heads
    if spec.arch == "mistral":
        shape["sliding_window"] = None
    return cls(**shape, **common)


def _template_into_tokenizer_config(folder: Path, template: str) -> None:
    """Keep the chat template inside tokenizer_config.json, where every transformers
    version looks (v5 writes it to a separate chat_template.jinja by default), and name a
    tokenizer class that v4 knows too."""
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["padding_side"] = "left"  # batched generation pads on the left
    cfg_path.write_text(json.dumps(cfg, indent=1, ensure_ascii=False) + "\n")
    (folder / "chat_template.jinja").unlink(missing_ok=True)


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple
