"""LoRA SFT through peft (train/lora.py): only the adapter trains,
checkpoints and the final model are adapter folders that peft and the engine load as they
are, a run resumed from an adapter checkpoint follows the uninterrupted curve, and an
adapter can be continued or merged into a plain model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from flywheel.config import SFTConfig, validate
from flywheel.inference import LocalEngine, SamplingParams
from flywheel.inference.decode import DecodeRequest
from flywheel.models import TinySpec, build_tiny_model
from flywheel.train.checkpoint import list_checkpoints
from flywheel.inference.lora import AdapterError
from flywheel.train.lora import merged_folder
from flywheel.train.metrics import read_metrics
from flywheel.train.sft import run_sft

peft = pytest.importorskip("peft")
ROWS = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(10) for b in range(10)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_lora")
    data = root / "digits.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    model = build_tiny_model(root / "model", TinySpec(hidden=64, layers=2, heads=4, ffn=128, seed=0))
    return root, model, data


def config(model, data, out, **train):
    return validate(dict(model=str(model), output_dir=str(out), data={"train": [str(data)]},
                         train={"steps": 8, "batch_size": 16, "micro_batch_size": 16,
                                "lora": {"rank": 4, "alpha": 8}, **train},
                         optim={"lr": 1e-2, "warmup_steps": 0}, checkpoint={"every": 4, "keep": 3},
                         log={"progress": False}, threads=1), SFTConfig)


def losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(Path(out) / "metrics.jsonl") if "loss" in r}


def test_lora_sft_trains_the_adapter_alone_and_saves_adapter_folders(setup, tmp_path):
    root, model, data = setup
    logs: list[str] = []
    result = run_sft(config(model, data, tmp_path / "run"), log=logs.append)
    assert any(m.startswith("LoRA: training ") for m in logs), logs
    final = result.final_model
    assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == str(model.resolve())
    assert all((c / "adapter_config.json").is_file() for c in list_checkpoints(tmp_path / "run"))
    curve = losses(tmp_path / "run")
    assert curve[8] < curve[1]  # the adapter moved the loss
    # the engine serves the adapter over the untouched base; its answers are peft's
    engine = LocalEngine.from_path(str(model))
    engine.adapters.register("ft", final)
    prompt = engine.encode(ROWS[7]["prompt"])
    batch = engine.batch()
    batch.admit([DecodeRequest("ft", prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                               adapter="ft")])
    done = {}
    while batch.live:
        done.update(batch.step().finished)
    [sample] = done["ft"]
    reference = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), final)
    ids = torch.tensor([prompt + sample.token_ids])
    with torch.no_grad():
        lp = torch.log_softmax(reference(input_ids=ids).logits[0, len(prompt) - 1:-1], -1)
    want = lp.gather(-1, torch.tensor(sample.token_ids)[:, None])[:, 0]
    assert (torch.tensor(sample.logprobs) - want).abs().max() < 1e-4
    # merged into a plain model folder: the same function
    merged = merged_folder(final, tmp_path / "merged")
    plain = AutoModelForCausalLM.from_pretrained(merged)
    with torch.no_grad():
        assert (plain(input_ids=ids).logits - reference(input_ids=ids).logits).abs().max() < 1e-4


def test_a_resumed_lora_run_follows_the_uninterrupted_curve(setup, tmp_path):
    root, model, data = setup
    run_sft(config(model, data, tmp_path / "run"), log=lambda m: None)
    reference = losses(tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "final")
    for ckpt in list_checkpoints(tmp_path / "run"):
        if ckpt.name != "step_00000004":
            shutil.rmtree(ckpt)  # as if killed after the checkpoint of step 4
    cfg = config(model, data, tmp_path / "run").model_copy(update={"resume": True})
    assert run_sft(cfg, log=lambda m: None).resumed_from == 4
    resumed = losses(tmp_path / "run")
    assert max(abs(resumed[s] - reference[s]) for s in range(5, 9)) < 1e-5


def test_an_adapter_continues_as_it_is_and_refuses_another_shape(setup, tmp_path):
    root, model, data = setup
    first = run_sft(config(model, data, tmp_path / "a", steps=4), log=lambda m: None).final_model
    again = run_sft(config(first, data, tmp_path / "b", steps=4), log=lambda m: None)  # from_checkpoint
    assert json.loads((again.final_model / "adapter_config.json").read_text())["r"] == 4
    with pytest.raises(AdapterError, match="the adapter has rank 4"):
        run_sft(config(first, data, tmp_path / "c", steps=4, lora={"rank": 8}), log=lambda m: None)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_activation_checkpointing_gives_the_same_steps(setup, tmp_path, lora):
    """Recomputing activations in the backward pass changes memory, not the numbers."""
    _, model, data = setup
    runs = {}
    for ckpt in (False, True):
        cfg = config(model, data, tmp_path / f"ckpt-{ckpt}", steps=3, activation_checkpointing=ckpt,
                     **({} if lora else {"lora": None}))
        run_sft(cfg, log=lambda m: None)
        runs[ckpt] = losses(tmp_path / f"ckpt-{ckpt}")
    assert runs[True].keys() == runs[False].keys() == {1, 2, 3}
    for step in runs[False]:
        assert abs(runs[True][step] - runs[False][step]) < 1e-5, (step, runs)


def test_distilled_rows_train_toward_the_model_with_its_adapter_off(setup, tmp_path):
    """peft starts B at zero, so the adapted model is its reference: distilled rows start at KL 0
    and stay near it, where the same rows imitated train the adapter; the KL at a moved adapter
    is the one computed by hand from the bare base model's logits."""
    from peft import PeftModel

    from flywheel.train.forward import distill_loss
    from flywheel.train.losses import token_kl
    from flywheel.errors import TrainError

    root, model, _ = setup
    data = tmp_path / "distill.jsonl"
    data.write_text("".join(json.dumps({**r, "distill": True}) + "\n" for r in ROWS))
    run_sft(config(model, data, tmp_path / "distilled", steps=3))
    distilled = losses(tmp_path / "distilled")
    # step 1 is exact; after it Adam scales float noise (gradients ~1e-9 against eps 1e-8) into small moves
    assert abs(distilled[1]) < 1e-6 and all(abs(v) < 1e-2 for v in distilled.values())
    imitated = run_sft(config(model, root / "digits.jsonl", tmp_path / "imitated", steps=3))
    assert all(v > 0.5 for v in losses(tmp_path / "imitated").values())

    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model),
                                        str(imitated.final_model))  # B moved: a different model
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    attn, target = torch.ones_like(ids), torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]])
    loss, m = distill_loss(adapted, adapted.disable_adapter, ids, attn, target, normalizer=4.0)
    base = AutoModelForCausalLM.from_pretrained(model)
    keep = target[:, 1:].bool()
    with torch.no_grad():
        want = token_kl(base(input_ids=ids).logits[:, :-1][keep], adapted(input_ids=ids).logits[:, :-1][keep]).sum()
    assert m["tokens"] == 3 + 5 and float(want) > 1e-4
    assert m["kl_sum"] == pytest.approx(float(want), rel=1e-4) and float(loss) == pytest.approx(float(want) / 4, rel=1e-4)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in adapted.named_parameters() if "lora_" in n)

    with pytest.raises(TrainError, match=r"distill.jsonl:1 and 99 more rows ask 'distill': true.*train.lora"):
        run_sft(config(model, data, tmp_path / "full", lora=None))
