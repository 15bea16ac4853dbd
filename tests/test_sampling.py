"""Sampling: exact greedy, the counter-based RNG, top-k / top-p behaviour, reproducibility."""
import numpy as np

from kog_core.interfaces import SamplingParams
from kog_core.sampling import philox4x32, philox_uniform, sample_token


def test_philox_matches_random123_known_answers():
    assert philox4x32((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert philox4x32((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    assert philox4x32((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == \
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


def test_greedy_is_argmax_with_lowest_index_on_ties():
    logits = np.array([0.1, 3.0, -1.0, 3.0], np.float32)
    assert sample_token(logits, SamplingParams(temperature=0.0), 0) == 1


def test_same_seed_same_tokens_other_seed_other_tokens():
    rng = np.random.default_rng(0)
    logits = [rng.standard_normal(1000).astype(np.float32) for _ in range(50)]
    draw = lambda seed: [sample_token(l, SamplingParams(temperature=1.0, seed=seed), i) for i, l in enumerate(logits)]
    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_top_k_one_is_greedy_and_top_k_restricts():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal(500).astype(np.float32)
    top5 = set(np.argsort(-logits)[:5].tolist())
    for step in range(200):
        assert sample_token(logits, SamplingParams(temperature=2.0, top_k=1, seed=3), step) == int(np.argmax(logits))
        assert sample_token(logits, SamplingParams(temperature=2.0, top_k=5, seed=3), step) in top5


def test_top_p_keeps_the_smallest_nucleus():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    seen = {sample_token(logits, SamplingParams(temperature=1.0, top_p=0.7, seed=11), s) for s in range(400)}
    assert seen == {0, 1}


def test_temperature_sampling_follows_the_distribution():
    probs = np.array([0.6, 0.3, 0.1])
    logits = np.log(probs).astype(np.float32)
    draws = [sample_token(logits, SamplingParams(temperature=1.0, seed=5), s) for s in range(4000)]
    freq = np.bincount(draws, minlength=3) / len(draws)
    assert np.allclose(freq, probs, atol=0.03)


def test_uniform_is_in_unit_interval_and_varies():
    us = [philox_uniform(123, s) for s in range(1000)]
    assert all(0.0 <= u < 1.0 for u in us)
    assert 0.45 < float(np.mean(us)) < 0.55
