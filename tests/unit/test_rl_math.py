"""Advantages and RL / DPO losses against numbers worked out by hand."""

import math

import pytest
import torch

from flywheel.rollout.advantages import (batch_normalized_advantages, dr_grpo_advantages, grpo_advantages, informative,
                                         rloo_advantages)
from flywheel.train.losses import aggregate, dpo_loss, k3_kl, policy_loss

R = torch.tensor([1.0, 0.0, 0.0, 1.0])  # mean 0.5, population std 0.5


def close(a, b, tol=1e-6):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol)


def test_advantages():
    assert close(grpo_advantages(R, eps=0.0), [1, -1, -1, 1])
    assert close(dr_grpo_advantages(R), [0.5, -0.5, -0.5, 0.5])
    # leave-one-out: 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3
    assert close(rloo_advantages(R), [2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert close(grpo_advantages(torch.ones(4)), [0, 0, 0, 0])  # no NaN on a flat group
    assert not informative(torch.ones(8)) and informative(R)
    with pytest.raises(ValueError):
        rloo_advantages(torch.ones(1))


def test_batch_normalized_advantages_share_one_std():
    # centred: [0.75, -0.25, -0.25, -0.25] and [0.5, 0.5, -0.5, -0.5]; their population variance
    # (0.5625 + 3 * 0.0625 + 4 * 0.25) / 8 = 0.21875, std 0.46771
    one_in_four, two_in_four = batch_normalized_advantages([torch.tensor([1.0, 0, 0, 0]), torch.tensor([1.0, 1, 0, 0])],
                                                           eps=0.0)
    std = math.sqrt(0.21875)
    assert close(one_in_four, [0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std])
    assert close(two_in_four, [0.5 / std, 0.5 / std, -0.5 / std, -0.5 / std])
    # per group, GRPO would scale the 1-in-4 group by its own std (0.433): 0.75 -> 1.732
    assert close(grpo_advantages(torch.tensor([1.0, 0, 0, 0]), eps=0.0)[0], 0.75 / math.sqrt(0.1875))
    assert batch_normalized_advantages([]) == []
    assert close(batch_normalized_advantages([torch.ones(4)])[0], [0, 0, 0, 0])  # flat: no NaN


LOGP = torch.zeros(2, 2)
MASK = torch.tensor([[1, 1], [1, 0]])
ADV = torch.tensor([1.0, -1.0])


def test_on_policy_loss_aggregations():
    # ratio 1 everywhere: per-token loss is -A: [[-1, -1], [1, masked]]
    assert policy_loss(LOGP, LOGP, ADV, MASK, aggregation="token")[0].item() == pytest.approx(-1 / 3)
    assert policy_loss(LOGP, LOGP, ADV, MASK, aggregation="sequence")[0].item() == pytest.approx(0.0)
    assert policy_loss(LOGP, LOGP, ADV, MASK, aggregation="constant", max_tokens=4)[0].item() == pytest.approx(-1 / 8)
    with pytest.raises(ValueError, match="max_tokens"):
        aggregate(LOGP, MASK, "constant")


def test_clipping_and_clip_higher():
    logp = torch.tensor([[0.5], [-0.5]])  # ratios e^0.5 = 1.6487 (A=+1), e^-0.5 = 0.6065 (A=-1)
    mask = torch.ones(2, 1)
    loss, m = policy_loss(logp, torch.zeros(2, 1), ADV, mask, eps_low=0.2, eps_high=0.2, aggregation="token")
    # A=+1: -min(1.6487, 1.2) = -1.2; A=-1: -min(-0.6065, -0.8) = 0.8
    assert loss.item() == pytest.approx((-1.2 + 0.8) / 2)
    assert m["clip_fraction"] == 1.0
    loss, _ = policy_loss(logp, torch.zeros(2, 1), ADV, mask, eps_low=0.2, eps_high=0.28, aggregation="token")
    assert loss.item() == pytest.approx((-1.28 + 0.8) / 2)


def test_gradient_of_unclipped_surrogate():
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(1, 2), torch.tensor([2.0]), torch.ones(1, 2), aggregation="token")
    loss.backward()
    assert close(logp.grad, [[-1.0, -1.0]])  # d/dlogp of -(ratio * 2) / 2 tokens, at ratio 1


def test_cispo_clips_a_detached_weight_and_keeps_every_gradient():
    # ratios e^0.5 = 1.6487 (A=+1) and e^-0.5 = 0.6065 (A=-1), both outside [0.8, 1.2]
    logp = torch.tensor([[0.5], [-0.5]], requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(2, 1), ADV, torch.ones(2, 1), objective="cispo")
    # l = -w * A * logp with w = clip(ratio): -(1.2 * 1 * 0.5) and -(0.8 * -1 * -0.5), mean of 2 tokens
    assert loss.item() == pytest.approx((-0.6 - 0.4) / 2)
    loss.backward()
    # PPO gives these clipped tokens no gradient; CISPO gives -w * A / 2 tokens
    assert close(logp.grad, [[-0.6], [0.4]])
    at_one = torch.zeros(1, 2, requires_grad=True)  # ratio 1: the same gradient as PPO's
    policy_loss(at_one, at_one.detach(), torch.tensor([2.0]), torch.ones(1, 2), objective="cispo")[0].backward()
    assert close(at_one.grad, [[-1.0, -1.0]])
    with pytest.raises(ValueError, match="unknown policy objective 'a2c'"):
        policy_loss(LOGP, LOGP, ADV, MASK, objective="a2c")


def test_k3_kl_and_reference_penalty():
    logp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    # d = log(0.25 / 0.5) = -log 2: e^d - d - 1 = 0.5 + log 2 - 1
    assert k3_kl(logp, ref).item() == pytest.approx(0.5 + math.log(2) - 1)
    assert k3_kl(logp, logp).item() == 0.0
    loss, m = policy_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 1), ref_logp_B_T=ref, kl_beta=0.1)
    assert loss.item() == pytest.approx(0.1 * (0.5 + math.log(2) - 1))
    assert m["kl_ref"] == pytest.approx(0.5 + math.log(2) - 1)


def test_truncated_importance_weight():
    old = torch.tensor([[math.log(0.6)], [math.log(0.3)]])
    behavior = torch.tensor([[math.log(0.2)], [math.log(0.3)]])  # weights min(3, 2) = 2 and 1
    loss, m = policy_loss(old, old, torch.tensor([1.0, 1.0]), torch.ones(2, 1), behavior_logp_B_T=behavior,
                          is_cap=2.0, aggregation="token")
    assert loss.item() == pytest.approx(-(2.0 + 1.0) / 2)
    assert m["is_weight_mean"] == pytest.approx(1.5)


def test_dpo_sigmoid_and_ipo():
    c, r, rc, rr = (torch.tensor([x]) for x in (-1.0, -3.0, -2.0, -2.0))  # h = 1 - (-1) = 2
    loss, m = dpo_loss(c, r, rc, rr, beta=0.5)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-1.0)))  # -log sigmoid(0.5 * 2)
    assert m["reward_margin"] == pytest.approx(1.0) and m["reward_accuracy"] == 1.0
    loss, _ = dpo_loss(c, r, rc, rr, beta=0.5, loss_type="ipo")
    assert loss.item() == pytest.approx((2 - 1 / (2 * 0.5)) ** 2)
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(c, r, rc, rr, loss_type="hinge")
