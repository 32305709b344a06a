"""A GGUF file -> a Hugging Face model folder (`flywheel model import`).

transformers dequantizes a GGUF's tensors to fp32 when it loads one (`gguf_file=`), for the
architectures and quantization types it maps. A GGUF-loaded model refuses `save_pretrained`,
so its weights are copied into a fresh model of the same config, and that one is saved:
model.safetensors, config.json, generation_config.json, tokenizer.json and the chat template.

The weights of a quantized GGUF are the quantization's, dequantized: a Q4_1 file gives 4-bit
weights in fp32 tensors, not the original model's. `flywheel_import.json` records the source
file, its sha256, its quantization types and which chat template the folder carries.

Chat templates: a template that renders no tools would drop a request's tools without a word.
Where the GGUF's own template renders none, the folder gets flywheel's tools-capable template
for the model's family (`TOOL_TEMPLATES`), and the import says so; a family without one keeps
its own template, and the server refuses requests with tools for it (serve/core.py).
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

RECORD = "flywheel_import.json"
OWN_TEMPLATE = "original_chat_template.jinja"  # the GGUF's own template, where flywheel's replaced it

# family -> flywheel's tools-capable template for it (models/*.jinja), chosen by a marker of
# the family's own template
TOOL_TEMPLATES = {"smollm2": "chat_template_smollm2_tools.jinja"}
FAMILY_MARKERS = {"smollm2": "named SmolLM, trained by Hugging Face"}


class GGUFImportError(ValueError):
    """The GGUF cannot be imported: names what (architecture, quantization type, file)."""


@dataclass
class ImportRecord:
    source: str  # the GGUF file imported
    sha256: str
    architecture: str  # GGUF general.architecture
    quantization: list[str]  # the tensors' GGML types, e.g. ["F32", "Q4_1", "Q6_K"]
    parameters: int
    chat_template: str  # "own" (the GGUF's), "own, no tools", "none", or the file of flywheel's that replaced it
    note: str = ""


# GGUF architecture names transformers' loader renames before its check
GGUF_RENAMES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2",
                "t5encoder": "t5"}


def supported_architectures() -> list[str]:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})  # metadata sections, not models


def supported_quantizations() -> list[str]:
    """GGML types the installed gguf package can dequantize."""
    import gguf
    from gguf.quants import _type_traits

    plain = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
    return sorted(t.name for t in set(_type_traits) | plain)


def inspect_gguf(path: Path) -> tuple[str, list[str]]:
    """(architecture, quantization types) from the file's header, checked against what this
    transformers and gguf can load; a GGUFImportError naming the unsupported one otherwise."""
    try:
        import gguf
    except ModuleNotFoundError as e:
        raise GGUFImportError("importing a GGUF needs the `gguf` package: pip install 'flywheel[gguf]'") from e
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - any parse failure means "not a GGUF we can read"
        raise GGUFImportError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        raise GGUFImportError(f"{path}: the GGUF header has no general.architecture")
    architecture = bytes(arch_field.parts[arch_field.data[0]]).decode()
    architectures = supported_architectures()
    if GGUF_RENAMES.get(architecture, architecture) not in architectures:
        raise GGUFImportError(f"{path}: architecture {architecture!r} is not supported by transformers' GGUF loader; "
                              f"supported: {', '.join(architectures)}")
    types = sorted({t.tensor_type.name for t in reader.tensors})
    quantizations = supported_quantizations()
    unsupported = [t for t in types if t not in quantizations]
    if unsupported:
        raise GGUFImportError(f"{path}: quantization type(s) {', '.join(unsupported)} cannot be dequantized; "
                              f"supported: {', '.join(quantizations)}")
    return architecture, types


def family_of(template: str) -> str | None:
    return next((f for f, marker in FAMILY_MARKERS.items() if marker in template), None)


def tool_template(family: str) -> str:
    return resources.files("flywheel.models").joinpath(TOOL_TEMPLATES[family]).read_text(encoding="utf-8")


def import_gguf(path: str | Path, out: str | Path, log=print, source: str | None = None) -> Path:
    """Write the HF folder of GGUF `path` to `out` (replaced if it exists) and return it.
    `source`: where the file came from, for the record (default: its path)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flywheel.models.chat import ChatRenderer
    from flywheel.models.loading import quiet_transformers

    path, out = Path(path).resolve(), Path(out)
    if not path.is_file():
        raise GGUFImportError(f"{path}: no such file")
    architecture, types = inspect_gguf(path)
    quiet_transformers()
    log(f"dequantizing {path.name} ({architecture}, {'/'.join(types)}) to fp32 ...")
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):  # the weights are now plain fp32: a folder saved with the
        del config.quantization_config  # GGUF marker would load as GGUF-quantized and refuse to save
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    if model.config.tie_word_embeddings:
        model.tie_weights()
    template = tokenizer.chat_template or ""
    chosen = "own" if template else "none"
    own = None  # the GGUF's template, kept beside flywheel's when that replaces it
    if template and not ChatRenderer(tokenizer).renders_tools:
        family = family_of(template)
        if family is None:
            chosen = "own, no tools"
            log("its chat template renders no tools, and flywheel has no tools template for this family: "
                "requests with tools will be refused")
        else:
            own = template
            tokenizer.chat_template = tool_template(family)
            chosen = TOOL_TEMPLATES[family]
            log(f"its chat template renders no tools: using flywheel's {chosen} ({family}'s tool format)")
    staging = out.with_name(out.name + ".importing")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if own is not None:
        (staging / OWN_TEMPLATE).write_text(own, encoding="utf-8")
    n = sum(p.numel() for p in model.parameters())
    quantized = [t for t in types if t not in ("F32", "F16", "BF16")]
    record = ImportRecord(source or str(path), _sha256(path), architecture, types, n, chosen,
                          note=(f"weights dequantized from a {'/'.join(quantized)} quantization, not the original "
                                "model's" if quantized else ""))
    (staging / RECORD).write_text(json.dumps(asdict(record), indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    log(f"wrote {out} ({n / 1e6:.1f}M parameters)")
    return out


def read_record(folder: str | Path) -> ImportRecord | None:
    f = Path(folder) / RECORD
    return ImportRecord(**json.loads(f.read_text())) if f.is_file() else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
