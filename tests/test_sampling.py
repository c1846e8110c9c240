import math

import numpy
import pytest
import torch

from cosyapp.models.sampling import (
    EOS_TOKEN,
    SamplingParams,
    draw_tokens,
    ras_distribution,
    ras_sample,
    recent_window,
    uniform_bits,
)

V = 6564
PARAMS = SamplingParams()


def logits_with(probs: dict[int, float], rest: float = 1e-9) -> torch.Tensor:
    """Logits whose softmax puts ``probs`` on the given ids and ``rest`` on each other id."""
    p = torch.full((V,), rest, dtype=torch.float64)
    for i, v in probs.items():
        p[i] = v
    return (p / p.sum()).log().float()


def draw(logits: torch.Tensor, history: list[int], n: int, eos_allowed: bool = True, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    batch = logits.expand(n, V).clone()
    recent = recent_window([history] * n, PARAMS.win_size)
    return ras_sample(batch, recent, torch.full((n,), eos_allowed), PARAMS, gen)


def frequencies(tokens: torch.Tensor) -> dict[int, float]:
    ids, counts = tokens.unique(return_counts=True)
    return {int(i): int(c) / len(tokens) for i, c in zip(ids, counts, strict=True)}


def test_nucleus_keeps_the_token_that_crosses_top_p_and_draws_in_proportion():
    logits = logits_with({7: 0.5, 3: 0.2, 9: 0.15, 4: 0.1, 5: 0.05}, rest=0.0)
    freq = frequencies(draw(logits, [], 10_000))
    # Kept set: 0.5 (mass before 0) + 0.2 (0.5) + 0.15 (0.7); 4 and 5 come after the mass reached 0.85.
    assert set(freq) == {7, 3, 9}
    for token, p in [(7, 0.5), (3, 0.2), (9, 0.15)]:
        assert freq[token] == pytest.approx(p / 0.85, abs=0.02)


def test_nucleus_is_capped_at_top_k_tokens():
    logits = torch.zeros(V)
    logits[:100] = 5.0  # 100 equally likely tokens hold almost all the mass
    freq = frequencies(draw(logits, [], 8_000))
    # Stable sort: the first 25 ids among equals are kept; each drawn about 1/25 of the time.
    assert set(freq) == set(range(25))
    assert max(freq.values()) < 1 / 25 + 0.012 and min(freq.values()) > 1 / 25 - 0.012


def test_repeated_token_falls_back_to_the_full_distribution_without_it():
    probs = {11: 0.6, 12: 0.3, 13: 0.1}
    history = [11] + [20 + i for i in range(9)]  # 11 is within the last 10 generated tokens
    freq = frequencies(draw(logits_with(probs, rest=0.0), history, 10_000))
    # Nucleus keeps {11, 12} (0.6 + 0.3 crosses 0.8); drawing 11 (p 0.6/0.9) triggers a redraw from
    # the full distribution with 11 masked: 12 with 0.3/0.4, 13 with 0.1/0.4.
    expected = {12: (0.3 / 0.9) + (0.6 / 0.9) * 0.75, 13: (0.6 / 0.9) * 0.25}
    assert set(freq) == {12, 13}
    for token, p in expected.items():
        assert freq[token] == pytest.approx(p, abs=0.02)


def test_repetition_window_covers_only_the_last_ten_generated_tokens():
    logits = logits_with({11: 0.5, 12: 0.5}, rest=0.0)
    outside = [11] + [20 + i for i in range(10)]  # 11 is 11 tokens back
    inside = outside[1:] + [11]
    assert frequencies(draw(logits, outside, 8_000))[11] == pytest.approx(0.5, abs=0.02)
    assert frequencies(draw(logits, inside, 8_000)) == {12: 1.0}


def test_eos_is_masked_before_min_len_but_other_stop_tokens_are_not():
    logits = logits_with({EOS_TOKEN: 0.9, 6562: 0.06, 100: 0.04}, rest=0.0)
    masked = frequencies(draw(logits, [], 8_000, eos_allowed=False))
    assert EOS_TOKEN not in masked
    assert masked[6562] == pytest.approx(0.6, abs=0.025)
    # Allowed, EOS alone already holds 0.9 >= top_p: the nucleus is {EOS}.
    assert frequencies(draw(logits, [], 1_000, eos_allowed=True)) == {EOS_TOKEN: 1.0}


def test_eos_stays_masked_in_the_repetition_fallback():
    logits = logits_with({50: 0.5, EOS_TOKEN: 0.5}, rest=1e-6)
    tokens = draw(logits, [50], 2_000, eos_allowed=False)
    # 50 is the only allowed token and it repeats: the fallback cannot pick EOS, only the tail.
    assert EOS_TOKEN not in tokens.tolist() and 50 not in tokens.tolist()


def test_rows_are_sampled_independently():
    a = logits_with({1: 1.0}, rest=0.0)
    b = logits_with({2: 1.0}, rest=0.0)
    tokens = ras_sample(torch.stack([a, b]), recent_window([[], []], 10), torch.tensor([True, True]), PARAMS)
    assert tokens.tolist() == [1, 2]


def test_recent_window_left_pads_and_keeps_the_latest():
    window = recent_window([[1, 2, 3], list(range(15))], 10)
    assert window[0].tolist() == [-1] * 7 + [1, 2, 3]
    assert window[1].tolist() == list(range(5, 15))


def test_length_limits_follow_the_text_token_ratios():
    assert PARAMS.length_limits(7) == (14, 140)
    assert SamplingParams(min_token_text_ratio=2.5).length_limits(3) == (math.floor(7.5), 60)


@pytest.mark.parametrize(
    ("probs", "history", "eos_allowed"),
    [
        ({11: 0.6, 12: 0.3, 13: 0.1}, [11, 1, 2], True),
        ({11: 0.35, 12: 0.3, 13: 0.2, EOS_TOKEN: 0.15}, [12, 11, 5], False),
        ({EOS_TOKEN: 0.5, 6562: 0.3, 7: 0.2}, [7], True),
    ],
)
def test_ras_distribution_matches_the_reference_procedure(probs, history, eos_allowed):
    logits = logits_with(probs, rest=1e-4)
    n = 20_000
    sampled = frequencies(draw(logits, history, n, eos_allowed=eos_allowed, seed=1))
    q = ras_distribution(
        logits[None], recent_window([history], PARAMS.win_size), torch.tensor([eos_allowed]), PARAMS
    )[0]
    assert q.sum().item() == pytest.approx(1.0, abs=1e-5)
    for token in set(sampled) | set(probs):
        expected = q[token].item()
        # Binomial standard error; 5 sigma keeps this deterministic-seed test far from flaky.
        tolerance = 5 * math.sqrt(max(expected * (1 - expected), 1e-4) / n)
        assert sampled.get(token, 0.0) == pytest.approx(expected, abs=tolerance), token


def test_ras_distribution_without_repeats_is_the_renormalised_nucleus():
    logits = logits_with({7: 0.5, 3: 0.2, 9: 0.15, 4: 0.1, 5: 0.05}, rest=0.0)
    q = ras_distribution(logits[None], recent_window([[]], 10), torch.tensor([True]), PARAMS)[0]
    expected = torch.zeros(V)
    expected[[7, 3, 9]] = torch.tensor([0.5, 0.2, 0.15]) / 0.85
    torch.testing.assert_close(q, expected, atol=1e-6, rtol=1e-5)


# --- the vLLM engine's draw: one uniform per (seed, position), inverse transform ---------------------


def test_uniform_bits_depend_on_seed_and_position_only_and_look_uniform():
    seeds, positions = list(range(5000)), [3] * 5000
    bits = uniform_bits(seeds, positions)
    assert bits.dtype.name == "int64" and bits.min() >= 0 and bits.max() < 2**52
    # The same (seed, position) gives the same bits in any batch, order or company.
    assert uniform_bits([41, 7], [3, 3])[1] == bits[7] == uniform_bits([7], [3])[0]
    assert len(set(bits.tolist())) == len(bits)
    assert uniform_bits([7], [4])[0] != bits[7]  # the next token of a request draws anew
    assert (
        uniform_bits([2**64 + 7], [3])[0] == bits[7]
        and uniform_bits([-1], [0])[0] == uniform_bits([2**64 - 1], [0])[0]
    )
    # Ten equal bins over [0, 1), and successive positions of one seed uncorrelated.
    u = bits / 2**52
    counts = torch.bincount(torch.from_numpy((u * 10).astype("int64")), minlength=10).double()
    assert float(((counts - 500) ** 2 / 500).sum()) < 35  # chi-square, 9 degrees of freedom: p < 1e-4
    walk = uniform_bits([5] * 5000, list(range(5000))) / 2**52
    assert abs(float(numpy.corrcoef(walk[:-1], walk[1:])[0, 1])) < 0.06


def test_draw_tokens_inverts_the_cumulative_mass_and_skips_zero_probabilities():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0]])
    at = lambda u: torch.tensor([int(u * 2**52)] * 2)  # noqa: E731
    assert draw_tokens(probs, at(0.0)).tolist() == [1, 4]
    assert draw_tokens(probs, at(0.2499)).tolist() == [1, 4]
    assert draw_tokens(probs, at(0.25)).tolist() == [3, 4]
    assert draw_tokens(probs, torch.tensor([2**52 - 1] * 2)).tolist() == [3, 4]  # never past the last mass


def test_draw_tokens_over_many_seeds_follows_the_ras_distribution():
    logits = logits_with({11: 0.35, 12: 0.3, 13: 0.2, EOS_TOKEN: 0.15}, rest=1e-4)
    history, n = [12, 11, 5], 20_000
    q = ras_distribution(
        logits[None], recent_window([history], PARAMS.win_size), torch.tensor([False]), PARAMS
    )
    bits = torch.from_numpy(uniform_bits(range(n), [len(history)] * n))
    sampled = frequencies(draw_tokens(q.expand(n, V), bits))
    for token in set(sampled) | {11, 12, 13, EOS_TOKEN}:
        expected = q[0, token].item()
        tolerance = 5 * math.sqrt(max(expected * (1 - expected), 1e-4) / n)
        assert sampled.get(token, 0.0) == pytest.approx(expected, abs=tolerance), token
