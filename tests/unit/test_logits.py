"""Sampling math on hand-worked distributions."""

import math

import torch

from flywheel.inference.logits import filter_logits, sample_tokens

LOGITS = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]])


def _filtered_probs(temperature=1.0, top_k=0, top_p=1.0):
    out = filter_logits(LOGITS, torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]))
    return out.softmax(-1)[0].tolist()


def test_no_filter_keeps_distribution():
    assert _filtered_probs() == pytest_approx([0.5, 0.3, 0.2])


def test_top_k_two_renormalises_first_two():
    # 0.5 / 0.8 and 0.3 / 0.8
    assert _filtered_probs(top_k=2) == pytest_approx([0.625, 0.375, 0.0])


def test_top_p_keeps_smallest_set_reaching_p():
    # mass strictly before each token: 0, 0.5, 0.8 -> p=0.6 keeps the first two
    assert _filtered_probs(top_p=0.6) == pytest_approx([0.625, 0.375, 0.0])
    # p=0.5: the first token alone reaches it
    assert _filtered_probs(top_p=0.5) == pytest_approx([1.0, 0.0, 0.0])
    # a tiny p still keeps the most likely token
    assert _filtered_probs(top_p=1e-6) == pytest_approx([1.0, 0.0, 0.0])


def test_temperature_two_takes_square_roots():
    # softmax(log p / 2) is proportional to sqrt(p)
    s = [math.sqrt(0.5), math.sqrt(0.3), math.sqrt(0.2)]
    assert _filtered_probs(temperature=2.0) == pytest_approx([x / sum(s) for x in s])


def test_rows_have_their_own_parameters():
    logits = LOGITS.repeat(2, 1)
    out = filter_logits(logits, torch.tensor([1.0, 1.0]), torch.tensor([1, 0]), torch.tensor([1.0, 1.0]))
    assert torch.isinf(out[0, 1:]).all() and torch.isfinite(out[1]).all()


def test_gumbel_sampling_matches_probabilities():
    g = torch.Generator().manual_seed(0)
    logits = LOGITS.repeat(20000, 1)
    ones = torch.ones(20000)
    tokens, logprobs = sample_tokens(logits, ones, torch.zeros(20000, dtype=torch.long), ones, g)
    freq = torch.bincount(tokens, minlength=3).float() / 20000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.015)
    assert torch.allclose(logprobs, LOGITS[0].log_softmax(-1)[tokens])


def test_greedy_rows_take_argmax_and_raw_logprob():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]])
    tokens, logprobs = sample_tokens(logits, torch.zeros(2), torch.zeros(2, dtype=torch.long), torch.ones(2))
    assert tokens.tolist() == [1, 0]
    assert torch.allclose(logprobs, logits.log_softmax(-1)[[0, 1], [1, 0]])


def test_processed_logprobs_are_under_the_filtered_distribution():
    g = torch.Generator().manual_seed(1)
    tokens, logprobs = sample_tokens(LOGITS.repeat(50, 1), torch.ones(50), torch.full((50,), 2),
                                     torch.ones(50), g, processed_logprobs=True)
    assert set(tokens.tolist()) <= {0, 1}
    expected = torch.tensor([math.log(0.625), math.log(0.375)])[tokens]
    assert torch.allclose(logprobs, expected, atol=1e-6)


def pytest_approx(values):
    import pytest

    return pytest.approx(values, abs=1e-6)


def test_top_logprobs_are_sorted_and_share_the_sampled_tokens_distribution():
    """Processed rows report the filtered distribution (alternatives outside its support
    are -inf and dropped by top_pairs), raw and greedy rows the temperature-1 one; ids past
    `known` (vocabulary padding) are never listed."""
    from flywheel.inference.logits import reported_logprobs, top_logprobs, top_pairs

    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, 5.0]]).repeat(3, 1)  # (3, 5); id 4: vocabulary padding
    temperature, top_k, top_p = torch.tensor([0.5, 0.5, 0.0]), torch.tensor([2, 2, 2]), torch.ones(3)
    lp_B_V = reported_logprobs(logits, temperature, top_k, top_p, torch.tensor([True, False, True]))
    kept = (logits[0, [4, 1]] / 0.5).log_softmax(-1)  # top_k=2 at temperature 0.5 keeps ids 4 and 1
    assert torch.allclose(lp_B_V[0, [4, 1]], kept) and torch.isinf(lp_B_V[0, [0, 2, 3]]).all()
    raw = logits[1].log_softmax(-1)  # the raw row, and the greedy row although processed
    assert torch.allclose(lp_B_V[1], raw) and torch.allclose(lp_B_V[2], raw)
    ids, lps = top_logprobs(lp_B_V, 3, known=4)  # (3, 3) each
    assert ids[1:].tolist() == [[1, 2, 3], [1, 2, 3]] and ids[0, 0] == 1
    assert (lps[:, :-1] >= lps[:, 1:]).all() and (lps.exp().sum(-1) <= 1 + 1e-6).all()
    assert top_pairs(ids[0].tolist(), lps[0].tolist(), 3) == [(1, lps[0, 0].item())]
    assert top_pairs(ids[1].tolist(), lps[1].tolist(), 2) == [(1, raw[1].item()), (2, raw[2].item())]
