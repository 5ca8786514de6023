"""Key streams for experiments: uniform or Zipf-distributed keys, generated once per run
configuration from a seed, and the share of the hottest key (for the hot-key bound)."""

from __future__ import annotations

import itertools
import random

__all__ = ["DISTRIBUTIONS", "hottest_share", "key_stream"]

DISTRIBUTIONS = ("uniform", "zipf")


def _zipf_weights(n_keys: int, theta: float) -> list[float]:
    return [rank ** -theta for rank in range(1, n_keys + 1)]  # steep: the tail is 0.0


def hottest_share(distribution: str, n_keys: int, theta: float) -> float:
    """The probability of the most frequent key: 1/n_keys for uniform keys, 1/H(n, theta)
    for Zipf (the generalized harmonic number)."""
    if distribution == "uniform":
        return 1.0 / n_keys
    return 1.0 / sum(_zipf_weights(n_keys, theta))


def key_stream(distribution: str, n_keys: int, n_records: int, *, theta: float = 0.99,
               seed: int = 1) -> list[int]:
    """`n_records` keys in 0..n_keys-1, drawn independently: uniformly, or Zipf with
    exponent `theta` (key 0 the most frequent). Seeded, so a run can be repeated."""
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {', '.join(DISTRIBUTIONS)}, "
                         f"got {distribution!r}")
    rng = random.Random(seed)
    if distribution == "uniform":
        return [int(rng.random() * n_keys) for _ in range(n_records)]
    cumulative = list(itertools.accumulate(_zipf_weights(n_keys, theta)))
    return rng.choices(range(n_keys), cum_weights=cumulative, k=n_records)
