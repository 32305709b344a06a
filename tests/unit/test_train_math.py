"""Schedule, data order, padding and the SFT loss against numbers worked out by hand."""

import math

import pytest
import torch

from flywheel.rollout.data_order import DataOrder
from flywheel.train.padding import pad_batch
from flywheel.train.losses import token_nll_sum
from flywheel.train.schedule import lr_multiplier


def test_warmup_then_cosine_to_the_floor():
    # warm-up 4 steps: 1/4, 2/4, 3/4, 4/4; then 11 - 4 - 1 = 6 decay steps
    assert [lr_multiplier(s, 4, 11, 0.1) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_multiplier(4, 4, 11, 0.1) == pytest.approx(1.0)
    # halfway (3 of 6 decay steps): 0.1 + 0.9 * (1 + cos(pi/2)) / 2 = 0.55
    assert lr_multiplier(7, 4, 11, 0.1) == pytest.approx(0.55)
    assert lr_multiplier(10, 4, 11, 0.1) == pytest.approx(0.1)
    assert lr_multiplier(50, 4, 11, 0.1) == pytest.approx(0.1)
    assert lr_multiplier(0, 0, 3, 0.0) == 1.0


def test_linear_and_constant_decay():
    # no warm-up, 11 steps: 10 decay steps; step 5 is halfway, step 10 the last
    assert lr_multiplier(5, 0, 11, 0.0, "linear") == pytest.approx(0.5)
    assert lr_multiplier(10, 0, 11, 0.0, "linear") == 0.0
    assert lr_multiplier(8, 0, 11, 0.2, "linear") == pytest.approx(0.2 + 0.8 * 0.2)
    assert [lr_multiplier(s, 2, 11, 0.1, "constant") for s in (0, 1, 2, 10)] == [0.5, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="unknown lr decay 'step'"):
        lr_multiplier(3, 0, 11, 0.1, "step")


def test_data_order_visits_every_example_per_epoch_and_resumes():
    order = DataOrder(size=5, seed=7)
    first = order.take(3) + order.take(2)
    assert sorted(first) == [0, 1, 2, 3, 4]
    second = order.take(5)
    assert sorted(second) == [0, 1, 2, 3, 4] and second != first  # a new shuffle each epoch
    a = DataOrder(size=5, seed=7)
    a.take(7)
    b = DataOrder(size=5, seed=7)
    b.load_state_dict(a.state_dict())
    assert a.take(6) == b.take(6)
    with pytest.raises(ValueError, match="data changed"):
        DataOrder(size=6, seed=7).load_state_dict(a.state_dict())


def test_pad_batch_right_pads():
    ids, attn, tmask = pad_batch([[5, 6, 7], [8]], [[0, 1, 1], [1]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert attn.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert tmask.tolist() == [[0, 1, 1], [1, 0, 0]]


def test_token_nll_sum_by_hand():
    # two positions over a 2-token vocabulary; logits (0, 0) -> p = 1/2; (ln 3, 0) -> p(0) = 3/4
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    targets = torch.tensor([1, 0])
    assert token_nll_sum(logits, targets).item() == pytest.approx(math.log(2) + math.log(4 / 3))


def test_targets_met_reads_losses_downward_and_the_rest_upward():
    import math

    from flywheel.train.sft import targets_met

    assert not targets_met({"eval/acc": 0.9}, {})
    assert targets_met({"eval/acc": 0.5, "val_loss": 1.0}, {"eval/acc": 0.5, "val_loss": 1.0})
    assert not targets_met({"eval/acc": 0.49, "val_loss": 0.5}, {"eval/acc": 0.5, "val_loss": 1.0})
    assert not targets_met({"eval/acc": 0.9, "val_loss": 1.01}, {"eval/acc": 0.5, "val_loss": 1.0})
    assert not targets_met({"eval/acc": math.nan}, {"eval/acc": 0.0})
