"""`flywheel model import` refuses what it cannot load, naming it, before any dequantizing.
(The import of a real GGUF is in tests/integration/test_real_model.py, slow tier.)"""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package (pip install 'flywheel[gguf]')")

from flywheel.models.gguf_import import GGUFImportError, import_gguf, inspect_gguf  # noqa: E402


def write_gguf(path, arch, tensors):
    w = gguf.GGUFWriter(str(path), arch)
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_an_unsupported_architecture_is_named_with_the_supported_ones(tmp_path):
    f = write_gguf(tmp_path / "m.gguf", "rwkv7", {"token_embd.weight": np.zeros((4, 2), np.float32)})
    with pytest.raises(GGUFImportError, match=r"architecture 'rwkv7' is not supported.*supported: .*llama.*qwen2"):
        inspect_gguf(f)


def test_an_unsupported_quantization_type_is_named(tmp_path):
    f = write_gguf(tmp_path / "m.gguf", "llama", {"token_embd.weight": np.zeros((4, 2), np.float32),
                                                  "blk.0.attn_q.weight": np.zeros((2, 2), np.int32)})
    with pytest.raises(GGUFImportError, match=r"quantization type\(s\) I32 cannot be dequantized; supported: .*Q4_1"):
        inspect_gguf(f)


def test_a_supported_header_passes_and_names_its_types(tmp_path):
    f = write_gguf(tmp_path / "m.gguf", "llama", {"token_embd.weight": np.zeros((4, 2), np.float32)})
    assert inspect_gguf(f) == ("llama", ["F32"])


def test_not_a_gguf_and_no_file_are_clear_errors(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    with pytest.raises(GGUFImportError, match="not a readable GGUF file"):
        inspect_gguf(junk)
    with pytest.raises(GGUFImportError, match="no such file"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out")
