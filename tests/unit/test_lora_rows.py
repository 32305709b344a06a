"""LoRA rows on the lean decoder (inference/lora.py), on its dense and its packed kernels: a
batch mixing rows of eight adapters and the bare base gives each row the logits of peft's own
forward of its adapter (or the base model's), within 1e-4; a row's result does not depend on its neighbours; adapter folders the
runner cannot serve are refused with the field named; under concurrent load through the batch
scheduler the engine keeps at most its bound of adapters resident and every row stays right."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from flywheel.inference.decoder import LeanDecoder
from flywheel.inference.lora import AdapterError, Resident, RowGroups, read_adapter
from flywheel.models import TinySpec, build_tiny_model

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_model(root / "base", TinySpec(hidden=32, layers=2, heads=4, kv_heads=2, ffn=64))
    folders = []
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    kinds = [(every, 4, False), (["v_proj", "down_proj"], 2, True), (["q_proj", "v_proj"], 8, False),
             (["o_proj"], 1, False), (["gate_proj", "up_proj"], 4, True), (every, 2, False),
             (["k_proj", "down_proj"], 3, False), (every, 8, True)]  # eight adapters of varied shapes
    for seed, (targets, r, rslora) in enumerate(kinds):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(base)
        cfg = peft.LoraConfig(r=r, lora_alpha=8, target_modules=targets, lora_dropout=0.0, use_rslora=rslora,
                              init_lora_weights=False)  # random A and B: a delta that shows
        peft.get_peft_model(model, cfg).save_pretrained(root / f"adapter{seed}")
        folders.append(root / f"adapter{seed}")
    return base, folders


def peft_logits(base: Path, folder: Path | None, ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(base)
    if folder is not None:
        model = peft.PeftModel.from_pretrained(model, folder)
    with torch.no_grad():
        return model(input_ids=ids).logits[:, -1].float()


def decoder_logits(decoder: LeanDecoder, ids: torch.Tensor, adapters) -> torch.Tensor:
    B, S = ids.shape
    cache = decoder.new_cache(B, S)
    positions = torch.arange(S)[None].expand(B, S)
    return decoder.forward(ids, positions, cache, None, True, lora=RowGroups(adapters, S, ids.device))


@pytest.mark.parametrize("packed", [False, True], ids=["dense kernels", "packed kernels"])
def test_a_mixed_batch_gives_each_row_what_peft_gives_its_adapter(world, packed):
    """On either kernel set: the packed one folds the norms' weights into q/k/v and gate/up and
    permutes q/k rows for RoPE, so an adapter's inputs and B rows must follow (kernels.py)."""
    base, folders = world
    decoder = LeanDecoder(AutoModelForCausalLM.from_pretrained(base), packed=packed)
    resident = [Resident(read_adapter(f), decoder.layout(), torch.float32, torch.device("cpu")) for f in folders]
    torch.manual_seed(0)
    ids = torch.randint(3, 60, (1, 7))
    want = {i: peft_logits(base, f, ids) for i, f in enumerate([None, *folders])}
    assert all((want[i] - want[0]).abs().max() > 1e-3 for i in range(1, 9))  # each adapter changes the answer
    rows = [None, *resident, resident[0], None, resident[5]]  # the base and all eight, interleaved
    got = decoder_logits(decoder, ids.expand(len(rows), -1), rows)
    for b, adapter in enumerate(rows):
        expected = want[0 if adapter is None else 1 + resident.index(adapter)][0]
        assert (got[b] - expected).abs().max() < 1e-4, b
    alone = decoder_logits(decoder, ids, [resident[1]])  # one adapter for the whole batch: the fast path
    assert (alone[0] - want[2][0]).abs().max() < 1e-4


def test_the_adapter_is_read_with_its_scaling(world):
    _, folders = world
    full, small = read_adapter(folders[0]), read_adapter(folders[1])
    assert full.scaling == 8 / 4 and small.scaling == pytest.approx(8 / 2 ** 0.5)  # alpha / r, alpha / sqrt(r)
    assert len(full.pairs) == 7 * 2 and sorted({m for _, m in small.pairs}) == ["down_proj", "v_proj"]


@pytest.mark.parametrize("field, value, words", [
    ("peft_type", "IA3", "only LoRA adapters"),
    ("use_dora", True, "not supported"),
    ("bias", "all", "biases"),
    ("rank_pattern", {"q_proj": 8}, "one rank and alpha"),
    ("r", 0, "positive"),
])
def test_adapters_the_runner_cannot_serve_are_refused_naming_the_field(world, tmp_path, field, value, words):
    _, folders = world
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((folders[0] / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, field: value}))
    (bad / "adapter_model.safetensors").write_bytes((folders[0] / "adapter_model.safetensors").read_bytes())
    with pytest.raises(AdapterError, match=f"{field}=.*{words}"):
        read_adapter(bad)


def test_an_adapter_of_another_model_shape_is_refused(world, tmp_path):
    _, folders = world
    other = build_tiny_model(tmp_path / "wide", TinySpec(hidden=48, layers=2, heads=4, kv_heads=2, ffn=64))
    decoder = LeanDecoder(AutoModelForCausalLM.from_pretrained(other), packed=False)
    with pytest.raises(AdapterError, match=r"the model's down_proj is 64 -> 48 in 2 layers"):
        Resident(read_adapter(folders[0]), decoder.layout(), torch.float32, torch.device("cpu"))


def reference_logprobs(base: Path, folder: Path | None, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log p(token_i | prompt, tokens_<i) under peft's forward of the adapter (or the base)."""
    model = AutoModelForCausalLM.from_pretrained(base)
    if folder is not None:
        model = peft.PeftModel.from_pretrained(model, folder)
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1:-1].float(), -1)
    return lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("packed", [False, True], ids=["dense kernels", "packed kernels"])
def test_an_engine_decodes_rows_of_different_adapters_in_one_batch(world, packed):
    from flywheel.inference import LocalEngine, SamplingParams
    from flywheel.inference.decode import DecodeRequest

    base, folders = world
    engine = LocalEngine.from_path(str(base), max_adapters=1, packed=packed)
    for i, folder in enumerate(folders[:2]):
        engine.adapters.register(f"a{i}", folder, load=False)
    prompt = [5, 9, 13, 21, 8]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    batch = engine.batch()
    batch.admit([DecodeRequest("base", prompt, params), DecodeRequest("x", prompt, params, adapter="a0")])
    done = dict(batch.step().finished)
    batch.admit([DecodeRequest("y", prompt, params, adapter="a1")])  # joins the running batch
    while batch.live:
        done.update(batch.step().finished)
    for key, folder in [("base", None), ("x", folders[0]), ("y", folders[1])]:
        [sample] = done[key]
        want = reference_logprobs(base, folder, prompt, sample.token_ids)
        assert (torch.tensor(sample.logprobs) - want).abs().max() < 1e-4, key
    assert len({tuple(done[k][0].token_ids) for k in done}) == 3  # three different models answered
    assert engine.adapters.resident == ["a1"] and engine.adapters.loads == 2  # the bound held
    with pytest.raises(ValueError, match="request 'z': no adapter 'nope' is registered"):
        engine.batch().admit([DecodeRequest("z", prompt, params, adapter="nope")])


def test_under_concurrent_load_the_resident_bound_holds_and_every_row_is_right(world):
    """48 callers at once through the BatchScheduler (the serving path), spread over the base and
    eight adapters on an engine that keeps at most 3 resident: adapters are read, dropped and
    read again, the bound holds at every step, and each completion's logprobs are peft's for its
    own adapter. An adapter unregistered meanwhile is refused by name; the others go on."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from flywheel.inference import LocalEngine, SamplingParams
    from flywheel.inference.scheduler import BatchScheduler

    base, folders = world
    engine = LocalEngine.from_path(str(base), max_adapters=3)
    for i, folder in enumerate(folders):
        engine.adapters.register(f"a{i}", folder, load=False)
    most, stop = [0], threading.Event()

    def watch():  # the resident count, sampled while the load runs
        while not stop.wait(0.001):
            most[0] = max(most[0], len(engine.adapters.resident))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    scheduler = BatchScheduler(engine, "v1", max_batch=16)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    names = [None] + [f"a{i}" for i in range(8)]
    jobs = [(k, [5 + k % 7, 9, 13 + k % 3, 21], names[k % 9]) for k in range(48)]
    try:
        with ThreadPoolExecutor(16) as pool:
            futures = list(pool.map(lambda j: scheduler.submit(j[1], params, adapter=j[2]), jobs))
            results = [f.result(timeout=120) for f in futures]
        engine.adapters.unregister("a7")
        with pytest.raises(ValueError, match="no adapter .a7. is registered"):
            scheduler.submit([5, 9], params, adapter="a7").result(timeout=30)
        assert scheduler.submit([5, 9], params, adapter="a6").result(timeout=30).samples[0].token_ids
    finally:
        stop.set()
        scheduler.close()
    assert most[0] <= 3 and len(engine.adapters.resident) <= 3
    assert engine.adapters.loads > 8  # dropped adapters were read again
    for (k, prompt, name), result in zip(jobs, results):
        folder = None if name is None else folders[int(name[1:])]
        [sample] = result.samples
        want = reference_logprobs(base, folder, prompt, sample.token_ids)
        assert (torch.tensor(sample.logprobs) - want).abs().max() < 1e-4, (k, name)


@pytest.mark.parametrize("rows", [[None, 0, 1, 0, None, 5, 7, 7, 7], [0, 1, 2, 3, 4, 5, 6, 7], [7, 0, 7, 1, 7, 0]],
                         ids=["uneven groups, base rows", "one token per adapter", "uneven groups, no base row"])
def test_a_decode_step_adds_each_token_its_own_adapters_delta(world, rows):
    _, folders = world
    decoder = LeanDecoder(AutoModelForCausalLM.from_pretrained(world[0]), packed=False)
    resident = [Resident(read_adapter(f), decoder.layout(), torch.float32, torch.device("cpu")) for f in folders]
    row_adapters = [None if r is None else resident[r] for r in rows]
    groups = RowGroups(row_adapters, 1, torch.device("cpu"))
    torch.manual_seed(1)
    for layer in range(2):
        for part, inp in (("qkv", 32), ("o", 32), ("gate", 32), ("up", 32), ("down", 64)):
            x = torch.randn(len(rows), inp)
            width = {"qkv": 32 + 2 * 16, "o": 32, "gate": 64, "up": 64, "down": 32}[part]
            base = torch.randn(len(rows), width)
            got = base.clone()
            groups.add(layer, part, x, got)
            for n, adapter in enumerate(row_adapters):
                ab = None if adapter is None else adapter.parts[layer][part]
                want = base[n] if ab is None else base[n] + (x[n] @ ab[0].T) @ ab[1].T
                assert torch.allclose(got[n], want, atol=1e-5), (layer, part, n)


def test_a_decode_batch_reuses_its_adapters_stack_whatever_the_rows_order(world):
    """Continuous batching reorders rows as requests join and leave: the same set of adapters
    keeps its stacked weights instead of copying them again."""
    _, folders = world
    decoder = LeanDecoder(AutoModelForCausalLM.from_pretrained(world[0]), packed=False)
    resident = [Resident(read_adapter(f), decoder.layout(), torch.float32, torch.device("cpu")) for f in folders[:3]]
    first = RowGroups([resident[0], resident[1], None, resident[2]], 1, torch.device("cpu"))
    again = RowGroups([resident[2], None, resident[1], resident[0], resident[0]], 1, torch.device("cpu"))
    assert again.stack is first.stack


def test_rows_of_several_adapters_share_a_prompt_prefix_each_with_its_own_keys(world):
    """A prefix the prompts share is computed once per owner (the base, each adapter) and kept:
    every row's logprobs stay its own model's, and a later prefill reuses each owner's entry."""
    from flywheel.inference import LocalEngine, SamplingParams
    from flywheel.inference.decode import SHARED_PREFIX_MIN

    base, folders = world
    engine = LocalEngine.from_path(str(base))
    for i, folder in enumerate(folders[:2]):
        engine.adapters.register(f"a{i}", folder)
    system = list(range(3, 3 + SHARED_PREFIX_MIN + 4))  # the prompts' common start
    questions = [[40, 41], [42, 43, 44], [45], [46, 47]]
    owners = ["a0", None, "a1", "a0"]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    shapes, forward = [], engine.runner.forward
    engine.runner.forward = lambda tokens, *a, **kw: (shapes.append(tuple(tokens.shape)), forward(tokens, *a, **kw))[1]
    out = engine.generate([system + q for q in questions], params, adapters=owners)
    assert shapes[:3] == [(1, len(system))] * 3  # the prefix under a0, the base, a1: once each
    assert len(engine.prefixes) == 3
    for q, owner, [sample] in zip(questions, owners, out):
        want = reference_logprobs(base, folders[int(owner[1])] if owner else None, system + q, sample.token_ids)
        assert (torch.tensor(sample.logprobs) - want).abs().max() < 1e-4, owner
    shapes.clear()
    later = engine.generate([system + [50, 51], system + [52]], params, adapters=["a1", None])
    assert shapes[0] == (2, 2) and engine.prefixes.hits == 1  # only the prompts' own tokens: both from the cache
    for prompt, owner, [sample] in zip([system + [50, 51], system + [52]], ["a1", None], later):
        want = reference_logprobs(base, folders[1] if owner else None, prompt, sample.token_ids)
        assert (torch.tensor(sample.logprobs) - want).abs().max() < 1e-4, owner
