"""The learner step moves probability toward positive-advantage samples."""

import torch

from flywheel.config import AlgoConfig
from flywheel.models import TinySpec, build_tiny_model, load
from flywheel.train.rl_step import RLStepConfig, assign_advantages, rl_step, split_groups, token_logprobs
from flywheel.types import Trajectory, TrajectoryGroup


FLAT_KEPT = AlgoConfig(dynamic_sampling=False)  # these tests' groups train even when their rewards are flat


def make_group(prompt, good, bad, behavior=-1.0):
    def traj(completion, reward):
        ids = prompt + completion
        mask = [0] * len(prompt) + [1] * len(completion)
        return Trajectory("t", ids, mask, [behavior if m else 0.0 for m in mask],
                          [0 if m else -1 for m in mask], reward)
    return TrajectoryGroup("t", [traj(good, 1.0), traj(bad, 0.0)])


def test_dynamic_sampling_drops_flat_groups():
    flat = make_group([1, 2], [3], [4])
    flat.trajectories[1].reward = 1.0
    kept = assign_advantages([flat, make_group([1, 2], [3], [4])], "grpo", dynamic_sampling=True)
    assert len(kept) == 1 and [round(a, 4) for a in kept[0].advantages] == [1.0, -1.0]


def test_step_raises_the_rewarded_completion(tmp_path):
    model, tok = load(build_tiny_model(tmp_path, TinySpec(hidden=64, layers=2, heads=4, ffn=128)))
    prompt, good, bad = [49, 50, 43], [55, 258], [56, 258]
    ids = torch.tensor([prompt + good, prompt + bad])
    with torch.no_grad():
        before, _ = token_logprobs(model, ids, torch.ones_like(ids))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # behaviour logprobs equal the learner's: an on-policy step, IS weights 1
    groups = [make_group(prompt, good, bad)]
    for t, row in zip(groups[0].trajectories, before):
        t.behavior_logprobs = [0.0] + [float(x) if m else 0.0 for x, m in zip(row, t.loss_mask[1:])]
    metrics = rl_step(model, opt, groups, RLStepConfig(algo=FLAT_KEPT), pad_id=tok.pad_token_id)
    with torch.no_grad():
        after, _ = token_logprobs(model, ids, torch.ones_like(ids))
    assert metrics["skipped"] == 0.0 and abs(metrics["is_weight_mean"] - 1.0) < 1e-4
    assert after[0, 2] > before[0, 2]  # log p(good first token) up
    assert after[1, 2] < before[1, 2]  # log p(bad first token) down


def test_non_finite_loss_skips_the_update(tmp_path):
    model, tok = load(build_tiny_model(tmp_path, TinySpec(hidden=64, layers=2, heads=4, ffn=128)))
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    group = make_group([1, 2], [3], [4], behavior=float("nan"))
    metrics = rl_step(model, opt, [group], RLStepConfig(algo=FLAT_KEPT), pad_id=tok.pad_token_id)
    assert metrics["skipped"] == 1.0
    assert all(torch.equal(v, snapshot[k]) for k, v in model.state_dict().items())


def test_split_groups_keeps_groups_whole_and_near_equal():
    assert split_groups(list(range(8)), 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert split_groups(list(range(8)), 1) == [list(range(8))]
    assert split_groups([0, 1], 4) == [[0], [1]]  # never an empty minibatch


class CountingAdamW(torch.optim.AdamW):
    calls = 0

    def step(self, closure=None):
        CountingAdamW.calls += 1
        return super().step(closure)


def test_minibatches_make_one_update_each_and_sum_what_they_trained(tmp_path):
    model, tok = load(build_tiny_model(tmp_path, TinySpec(hidden=64, layers=2, heads=4, ffn=128)))
    opt = CountingAdamW(model.parameters(), lr=1e-3)
    groups = [make_group([1, 2, k], [3, 258], [4, 5, 258]) for k in range(3)]
    metrics = rl_step(model, opt, groups, RLStepConfig(algo=FLAT_KEPT, minibatches=2), pad_id=tok.pad_token_id)
    assert CountingAdamW.calls == 2  # groups 0-1, then group 2
    assert metrics["groups"] == 3.0 and metrics["skipped"] == 0.0 and metrics["skipped_minibatches"] == 0.0
    assert metrics["trained_tokens"] == 3 * (2 + 3)  # every completion token of every group, once
    assert metrics["reward_mean"] == 0.5


def test_later_minibatches_take_their_ratio_to_the_weights_at_the_step_start(tmp_path, monkeypatch):
    """Minibatch 1 runs at ratio 1; minibatch 2 sees the weights minibatch 1 moved, so its
    ratio to the step's start differs from 1 and, at a large lr, the clip binds."""
    model, tok = load(build_tiny_model(tmp_path, TinySpec(hidden=64, layers=2, heads=4, ffn=128)))
    opt = torch.optim.AdamW(model.parameters(), lr=5e-2)
    groups = [make_group([1, 2, 7], [3, 258], [4, 258]) for _ in range(2)]
    parts = []
    import flywheel.train.rl_step as rl_step_module

    real_update = rl_step_module.update

    def spy(*args, **kwargs):
        parts.append(real_update(*args, **kwargs))
        return parts[-1]

    monkeypatch.setattr(rl_step_module, "update", spy)
    uncapped = RLStepConfig(algo=AlgoConfig(dynamic_sampling=False, is_cap=1e9), minibatches=2)
    rl_step(model, opt, groups, uncapped, pad_id=tok.pad_token_id)
    assert parts[0]["ratio_mean"] == 1.0 and parts[0]["clip_fraction"] == 0.0
    assert abs(parts[1]["ratio_mean"] - 1.0) > 1e-3 and parts[1]["clip_fraction"] > 0.0


def test_a_non_finite_minibatch_is_skipped_alone(tmp_path):
    model, tok = load(build_tiny_model(tmp_path, TinySpec(hidden=64, layers=2, heads=4, ffn=128)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    groups = [make_group([1, 2], [3], [4]), make_group([1, 2], [3], [4], behavior=float("nan"))]
    metrics = rl_step(model, opt, groups, RLStepConfig(algo=FLAT_KEPT, minibatches=2), pad_id=tok.pad_token_id)
    assert metrics["skipped"] == 0.0 and metrics["skipped_minibatches"] == 1.0


def test_learner_trains_the_tempered_policy_the_sampler_drew_from(tmp_path):
    """Rollouts at temperature 0.5 report logprobs of softmax(logits / 0.5) ("processed"); the
    learner at the same temperature sees no sampler-learner mismatch, one at 1.0 does."""
    import asyncio

    from flywheel.envs import load_env
    from flywheel.inference import LocalEngine, SamplingParams
    from flywheel.rollout.play import SamplerPolicy, play

    path = build_tiny_model(tmp_path, TinySpec(hidden=64, layers=2, heads=4, ffn=128))
    engine = LocalEngine.from_path(str(path), seed=0)
    env = load_env("arithmetic")
    params = SamplingParams(temperature=0.5, max_tokens=6, logprobs_mode="processed")
    groups = asyncio.run(play(env, env.tasks("train", n=4, seed=0), SamplerPolicy(engine, params), group_size=4))
    for g in groups:  # unequal rewards so that no group is dropped; the update is lr 0
        g.trajectories[0].reward = 1.0
    model, tok = load(path)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    tempered = rl_step(model, opt, groups, RLStepConfig(algo=FLAT_KEPT, temperature=0.5), pad_id=tok.pad_token_id)
    plain = rl_step(model, opt, groups, RLStepConfig(algo=FLAT_KEPT, temperature=1.0), pad_id=tok.pad_token_id)
    assert abs(tempered["mismatch_kl"]) < 1e-4 and abs(tempered["is_weight_mean"] - 1.0) < 1e-3
    assert abs(plain["mismatch_kl"]) > 1e-2


def test_the_step_config_carries_the_algo_section_and_each_rl_setting_by_name():
    """RLStepConfig.from_config takes `algo` as it is and FROM_SECTIONS' settings; a field
    added to RLStepConfig and not carried, nor learner-only, fails here."""
    from dataclasses import fields

    from flywheel.config import RLConfig, validate
    from flywheel.train.rl_step import FROM_SECTIONS, LEARNER_ONLY

    carried = {n for names in FROM_SECTIONS.values() for n in names}
    assert {f.name for f in fields(RLStepConfig)} == {"algo"} | carried | set(LEARNER_ONLY)
    assert not carried & set(LEARNER_ONLY)
    cfg = validate(dict(model="m", env={"name": "arithmetic"},
                        algo={"advantage": "rloo", "eps_low": 0.1, "eps_high": 0.3, "aggregation": "constant",
                              "dynamic_sampling": False, "is_cap": 3.0, "kl_beta": 0.05, "objective": "cispo"},
                        sampling={"max_tokens": 7, "temperature": 0.7}, optim={"grad_clip": 0.5},
                        train={"minibatches": 2, "groups_per_step": 2}), RLConfig)
    step = RLStepConfig.from_config(cfg)
    assert step.algo is cfg.algo
    assert step == RLStepConfig(algo=cfg.algo, max_tokens=7, temperature=0.7, grad_clip=0.5, minibatches=2)
    assert set(AlgoConfig.model_fields) == {"advantage", "eps_low", "eps_high", "aggregation", "dynamic_sampling",
                                            "is_cap", "kl_beta", "objective"}  # each set to a non-default value above
