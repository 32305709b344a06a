"""Shared-prefix and prefix-tree forwards give the plain forward's logprobs and gradients."""

import copy
import random

import pytest
import torch

from flywheel.config import AlgoConfig
from flywheel.models import TinySpec, build_tiny_model, load
from flywheel.train.rl_step import RLStepConfig, loss_position_logprobs, rl_step, token_logprobs
from flywheel.train.shared_prefix import (PlainPlan, PrefixTreePlan, SharedPrefixPlan, plan_batch, plan_kinds,
                                          supports_shared_prefix)
from flywheel.types import Trajectory, TrajectoryGroup

PAD = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # grouped-query attention (kv_heads < heads) exercises the repeat_kv path with a 4-D mask
    return build_tiny_model(tmp_path_factory.mktemp("m"), TinySpec(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128))


def fresh(model_dir, dtype=torch.float32, attn="sdpa"):
    model, _ = load(model_dir)
    if attn != "sdpa":
        model.set_attn_implementation(attn)
    with torch.no_grad():  # sharper distributions than the near-uniform init, so errors would show
        for p in model.parameters():
            p.mul_(4.0 if p.ndim > 1 else 1.0)
    return model.to(dtype).train()


def single_turn(rng, groups=3, size=4, dup=0.5):
    """rows: prompt (3..9 tokens, one per group) + completion (1..6 tokens, duplicates likely)."""
    ids, mask, rows = [], [], []
    for _ in range(groups):
        prompt = [rng.randrange(250) for _ in range(rng.randint(3, 9))]
        first = [rng.randrange(250) for _ in range(rng.randint(1, 6))]
        rows.append([])
        for _ in range(size):
            comp = list(first) if rng.random() < dup else [rng.randrange(250) for _ in range(rng.randint(1, 6))]
            rows[-1].append(len(ids))
            ids.append(prompt + comp)
            mask.append([0] * len(prompt) + [1] * len(comp))
    return ids, mask, rows


def multi_turn(rng, groups=2, size=4):
    """prompt, sampled turn, tool output (mask 0), sampled turn; some rows share turn one."""
    ids, mask, rows = [], [], []
    for _ in range(groups):
        prompt = [rng.randrange(250) for _ in range(rng.randint(4, 8))]
        turn1 = [rng.randrange(250) for _ in range(3)]
        rows.append([])
        for _ in range(size):
            t1 = list(turn1) if rng.random() < 0.5 else [rng.randrange(250) for _ in range(rng.randint(1, 4))]
            tool = [rng.randrange(250) for _ in range(rng.randint(2, 5))]
            t2 = [rng.randrange(250) for _ in range(rng.randint(1, 4))]
            rows[-1].append(len(ids))
            ids.append(prompt + t1 + tool + t2)
            mask.append([0] * len(prompt) + [1] * len(t1) + [0] * len(tool) + [1] * len(t2))
    return ids, mask, rows


def reference(model, ids, mask):
    """Plain full forward: logp at the loss positions (N,), row-major."""
    T = max(map(len, ids))
    ids_B_T = torch.tensor([r + [PAD] * (T - len(r)) for r in ids])
    attn = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in ids])
    m = torch.tensor([r + [0] * (T - len(r)) for r in mask])[:, 1:] != 0
    return token_logprobs(model, ids_B_T, attn)[0][m]


def logp_and_grads(model, fn, weights):
    model.zero_grad(set_to_none=True)
    logp = fn()
    (logp * weights).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(model, ids, mask, plan, tol):
    n = sum(sum(m[1:]) for m in mask)
    weights = torch.randn(n, generator=torch.Generator().manual_seed(0), dtype=next(model.parameters()).dtype)
    ref_lp, ref_g = logp_and_grads(model, lambda: reference(model, ids, mask), weights)
    lp, g = logp_and_grads(model, lambda: loss_position_logprobs(model, plan)[0], weights)
    assert lp.shape == ref_lp.shape
    assert (lp - ref_lp).abs().max() < tol
    for k in ref_g:
        scale = ref_g[k].abs().max().clamp_min(1.0)
        assert (g[k] - ref_g[k]).abs().max() / scale < tol, k


PLANS = {"tree": PrefixTreePlan, "prefix": SharedPrefixPlan}


@pytest.mark.parametrize("kind", ["tree", "prefix"])
@pytest.mark.parametrize("data", ["single", "multi"])
def test_equal_to_the_plain_forward_in_float64(model_dir, kind, data):
    model = fresh(model_dir, torch.float64)
    rng = random.Random(1)
    ids, mask, rows = single_turn(rng) if data == "single" else multi_turn(rng)
    plan = plan_batch(ids, mask, rows, PAD, "cpu", kinds=(kind,), min_saving=-1.0)
    assert isinstance(plan, PLANS[kind])
    assert_same(model, ids, mask, plan, 1e-6)


@pytest.mark.parametrize("kind", ["tree", "prefix"])
def test_equal_to_the_plain_forward_in_float32(model_dir, kind):
    model = fresh(model_dir)
    ids, mask, rows = single_turn(random.Random(2), groups=4, size=8)
    plan = plan_batch(ids, mask, rows, PAD, "cpu", kinds=(kind,), min_saving=-1.0)
    assert isinstance(plan, PLANS[kind])
    assert_same(model, ids, mask, plan, 1e-5)


@pytest.mark.parametrize("kind", ["tree", "prefix"])
def test_eager_attention_takes_the_additive_mask(model_dir, kind):
    model = fresh(model_dir, torch.float64, attn="eager")
    assert model.config._attn_implementation == "eager"
    ids, mask, rows = multi_turn(random.Random(3))
    plan = plan_batch(ids, mask, rows, PAD, "cpu", kinds=(kind,), min_saving=-1.0)
    assert_same(model, ids, mask, plan, 1e-6)


def test_multi_turn_prefix_stops_at_the_first_loss_token(model_dir):
    prompt, turn = [5, 6, 7, 8], [9, 10]
    ids = [prompt + turn + [20, 21] + [30], prompt + turn + [20, 22] + [31]]
    mask = [[0] * 4 + [1, 1] + [0, 0] + [1]] * 2
    plan = plan_batch(ids, mask, [[0, 1]], PAD, "cpu", kinds=("prefix",), min_saving=-1.0)
    assert plan.prefix_len_G.tolist() == [4]  # turn one is identical but holds loss tokens
    assert_same(fresh(model_dir, torch.float64), ids, mask, plan, 1e-6)
    tree = plan_batch(ids, mask, [[0, 1]], PAD, "cpu", kinds=("tree",), min_saving=-1.0)
    assert tree.ids_R_K.shape == (1, 4 + 2 + 1 + 2 * 1)  # the tree shares up to the divergence


def test_edge_cases(model_dir):
    """One-token completions (no suffix at all), a row without loss tokens, a one-row group,
    a group whose rows differ from the first token, exact duplicates, tiny tree bins."""
    model = fresh(model_dir, torch.float64)
    ids = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4],  # group 0: one-token completions, a duplicate
           [7, 8, 9], [7, 8, 9, 10, 11],  # group 1: row 3 has no loss token
           [12, 13, 14, 15],  # group 2: alone
           [16, 17, 18], [19, 17, 18, 20]]  # group 3: differs at token 0
    mask = [[0, 0, 0, 1], [0, 0, 0, 1], [0, 0, 0, 1],
            [0, 0, 0], [0, 0, 0, 1, 1],
            [0, 0, 1, 1],
            [0, 1, 1], [0, 0, 1, 1]]
    groups = [[0, 1, 2], [3, 4], [5], [6, 7]]
    prefix = plan_batch(ids, mask, groups, PAD, "cpu", kinds=("prefix",), min_saving=-1.0)
    assert prefix.prefix_len_G.tolist() == [3, 3, 2, 1, 2]  # group 3 split into two one-row prefixes
    assert_same(model, ids, mask, prefix, 1e-6)
    short = plan_batch(ids[:3], mask[:3], [[0, 1, 2]], PAD, "cpu", kinds=("prefix",), min_saving=-1.0)
    assert short.suffix_ids_B_C.shape[1] == 0  # the prefix forward alone
    assert_same(model, ids[:3], mask[:3], short, 1e-6)
    for rows in (None, 4):
        tree = plan_batch(ids, mask, groups, PAD, "cpu", kinds=("tree",), min_saving=-1.0, max_row_tokens=rows)
        assert isinstance(tree, PrefixTreePlan)
        assert_same(model, ids, mask, tree, 1e-6)
    assert plan_batch(ids, mask, groups, PAD, "cpu", kinds=("tree",), min_saving=-1.0,
                      max_row_tokens=4).ids_R_K.shape[0] == 4  # one bin per group


def test_plan_choice():
    rng = random.Random(4)
    ids, mask, rows = single_turn(rng, groups=8, size=8)
    assert isinstance(plan_batch(ids, mask, rows, PAD, "cpu"), PrefixTreePlan)
    assert isinstance(plan_batch(ids, mask, rows, PAD, "cpu", share=False), PlainPlan)
    # long distinct completions: attention over a packed tree would dominate, the cache plan wins
    prompt = list(range(200))
    long_ids = [prompt + [rng.randrange(250) for _ in range(400)] for _ in range(8)]
    long_mask = [[0] * 200 + [1] * 400] * 8
    assert isinstance(plan_batch(long_ids, long_mask, [list(range(8))], PAD, "cpu", attn_cost=1 / 512),
                      SharedPrefixPlan)
    # nothing shared: the plain plan
    solo = [[rng.randrange(250) for _ in range(6)] for _ in range(4)]
    assert isinstance(plan_batch(solo, [[0, 0, 1, 1, 1, 1]] * 4, [[0], [1], [2], [3]], PAD, "cpu"), PlainPlan)


def test_unsupported_attention_takes_the_plain_path(model_dir):
    model = fresh(model_dir)
    assert supports_shared_prefix(model) and plan_kinds(model) == ("tree", "prefix")
    model.config._attn_implementation_internal = "flash_attention_2"
    assert not supports_shared_prefix(model) and plan_kinds(model) == ()


def test_gradient_checkpointing_keeps_the_tree_only(model_dir):
    model = fresh(model_dir, torch.float64)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    assert plan_kinds(model) == ("tree",)  # checkpointing turns the KV cache off
    ids, mask, rows = multi_turn(random.Random(7))
    assert_same(model, ids, mask, plan_batch(ids, mask, rows, PAD, "cpu", kinds=plan_kinds(model),
                                             min_saving=-1.0), 1e-6)


def groups_from(ids, mask, rows, rewards):
    return [TrajectoryGroup("t", [Trajectory("t", ids[b], mask[b], [-1.0 * m for m in mask[b]], [0] * len(mask[b]),
                                             rewards[b]) for b in r]) for r in rows]


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_rl_step_matches_the_plain_step(model_dir, aggregation):
    rng = random.Random(5)
    ids, mask, rows = single_turn(rng, groups=3, size=4)
    rewards = [float(rng.random() < 0.5) for _ in ids]
    results = {}
    for share in (False, True):
        model = fresh(model_dir, torch.float64)
        ref = fresh(model_dir, torch.float64).eval()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # (Adam's first step is sign(g): noise-sensitive)
        cfg = RLStepConfig(algo=AlgoConfig(dynamic_sampling=False, aggregation=aggregation, kl_beta=0.1),
                           shared_prefix=share)
        m = rl_step(model, opt, groups_from(ids, mask, rows, rewards), cfg, PAD, ref_model=ref)
        results[share] = (m, [p.detach().clone() for p in model.parameters()])
    (m0, p0), (m1, p1) = results[False], results[True]
    assert m0["shared_prefix"] == 0.0 and m1["shared_prefix"] == 1.0
    for k in ("loss", "grad_norm", "entropy", "kl_ref", "clip_fraction", "is_weight_mean", "trained_tokens"):
        assert m1[k] == pytest.approx(m0[k], rel=1e-6, abs=1e-9), k
    assert max((a - b).abs().max().item() for a, b in zip(p0, p1)) < 1e-6


def test_bf16_autocast_stays_close(model_dir):
    model = fresh(model_dir)
    ids, mask, rows = single_turn(random.Random(6))
    plan = plan_batch(ids, mask, rows, PAD, "cpu")
    with torch.no_grad():
        exact, _ = loss_position_logprobs(model, plan)
        approx, _ = loss_position_logprobs(model, plan, autocast_bf16=True)
    assert approx.dtype == torch.float32
    assert (approx - exact).abs().max() < 0.25
    groups = groups_from(ids, mask, rows, [float(i % 2) for i in range(len(ids))])
    trained = copy.deepcopy(model)
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-3)
    m = rl_step(trained, opt, groups, RLStepConfig(algo=AlgoConfig(dynamic_sampling=False), autocast_bf16=True), PAD)
    assert m["skipped"] == 0.0


def test_rl_step_without_any_loss_token(model_dir):
    model = fresh(model_dir)
    group = TrajectoryGroup("t", [Trajectory("t", [1, 2, 3], [0, 0, 0], [0.0] * 3, [-1] * 3, r) for r in (0.0, 1.0)])
    m = rl_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), [group],
                RLStepConfig(algo=AlgoConfig(dynamic_sampling=False)), PAD)
    assert m["skipped"] == 0.0 and m["shared_prefix"] == 0.0 and m["loss"] == 0.0


def test_sft_loss_shares_a_common_system_prompt_and_matches_the_plain_loss(model_dir):
    """SFT rows repeating one long system prompt (tool schemas): the shared sum of -log p equals
    the plain forward's, and so do the gradients; a LoRA (peft) model shares too."""
    from peft import LoraConfig, get_peft_model

    from flywheel.train.forward import sft_loss
    from flywheel.train.padding import pad_batch
    from flywheel.train.shared_prefix import shared_nll_sum

    rng = random.Random(3)
    system = [rng.randrange(250) for _ in range(40)]
    ids, mask = [], []
    for _ in range(5):
        user = [rng.randrange(250) for _ in range(rng.randint(2, 6))]
        answer = [rng.randrange(250) for _ in range(rng.randint(1, 5))]
        ids.append(system + user + answer)
        mask.append([0] * (len(system) + len(user)) + [1] * len(answer))
    for wrap in (False, True):
        model = fresh(model_dir, torch.float64)
        if wrap:
            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
            with torch.no_grad():  # B = 0 at init: make the adapter matter
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.5)
        assert plan_kinds(model)  # a peft wrapper is looked through
        twin = copy.deepcopy(model)
        nll, n = shared_nll_sum(model, ids, mask, PAD, "cpu")
        nll.backward()
        pid, attn, tmask = pad_batch(ids, mask, PAD)
        plain, m = sft_loss(twin, pid, attn, tmask, normalizer=1.0)
        plain.backward()
        assert n == m["tokens"] == sum(sum(r[1:]) for r in mask)
        assert float(nll) == pytest.approx(float(plain), rel=1e-6)  # both take fp32 logits
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            if p.requires_grad:
                assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name


def test_sft_runs_its_plain_loss_where_sharing_saves_little(model_dir):
    from flywheel.train.shared_prefix import shared_nll_sum

    rows = [[5, 6, 7, 8, 9, 10], [5, 11, 12, 13, 14, 15]]  # one token in common
    assert shared_nll_sum(fresh(model_dir), rows, [[0, 0, 0, 1, 1, 1]] * 2, PAD, "cpu") is None
