"""Histogram: an HDR-style log-linear histogram of non-negative integers.

Values below 128 each get a bucket of their own; above, every power of two is cut into 64
buckets of equal width, so a bucket is at most 1/64 (1.6 %) as wide as the values it holds.
Recording is one index computation and one list increment, cheap enough for a per-batch (or
sampled per-record) call on the loop thread; percentiles report the middle of the bucket
that holds them (the exact value for values below 128). Latencies are recorded in whole
microseconds by convention (`record_seconds`).
"""

from __future__ import annotations

from typing import Any, Final

__all__ = ["Histogram"]

_SUB_BITS: Final = 7  # values below 2**7 are exact; each octave above has 2**6 buckets
_HALF: Final = 1 << (_SUB_BITS - 1)
_EXACT: Final = 1 << _SUB_BITS


def _index(value: int) -> int:
    if value < _EXACT:
        return value
    shift = value.bit_length() - _SUB_BITS
    return (shift << (_SUB_BITS - 1)) + (value >> shift)


def _bounds(index: int) -> tuple[int, int]:
    """[lower, upper) of bucket `index`."""
    if index < _EXACT:
        return index, index + 1
    shift = (index >> (_SUB_BITS - 1)) - 1
    lower = (index - (shift << (_SUB_BITS - 1))) << shift
    return lower, lower + (1 << shift)


class Histogram:
    """Counts of non-negative ints in log-linear buckets (see the module docstring)."""

    __slots__ = ("count", "counts", "max", "min", "total")

    def __init__(self) -> None:
        self.counts: list[int] = []
        self.count = 0
        self.total = 0
        self.min = 0
        self.max = 0

    def __repr__(self) -> str:
        if not self.count:
            return "<Histogram empty>"
        return (f"<Histogram n={self.count} mean={self.mean:.1f} p50={self.percentile(50):g} "
                f"p99={self.percentile(99):g} max={self.max}>")

    def record(self, value: int, n: int = 1) -> None:
        """Count `value` (an int >= 0; negative values count as 0) `n` times."""
        if value < 0:
            value = 0
        i = _index(value)
        counts = self.counts
        if i >= len(counts):
            counts.extend([0] * (i + 1 - len(counts)))
        counts[i] += n
        if not self.count or value < self.min:
            self.min = value
        if value > self.max:
            self.max = value
        self.count += n
        self.total += value * n

    def record_seconds(self, seconds: float, n: int = 1) -> None:
        """Count a duration in whole microseconds."""
        self.record(int(seconds * 1e6), n)

    def merge(self, other: Histogram) -> None:
        """Add every count of `other`."""
        if not other.count:
            return
        counts = self.counts
        if len(other.counts) > len(counts):
            counts.extend([0] * (len(other.counts) - len(counts)))
        for i, c in enumerate(other.counts):
            counts[i] += c
        self.min = other.min if not self.count else min(self.min, other.min)
        self.max = max(self.max, other.max)
        self.count += other.count
        self.total += other.total

    @property
    def mean(self) -> float:
        """The exact mean of the recorded values (0.0 when empty)."""
        return self.total / self.count if self.count else 0.0

    def percentile(self, q: float) -> float:
        """The value below which `q` percent of the counts lie (0.0 when empty): the middle
        of its bucket, clamped to the recorded minimum and maximum."""
        if not self.count:
            return 0.0
        rank = max(1, -(-int(q * self.count) // 100)) if q < 100 else self.count
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank:
                lower, upper = _bounds(i)
                middle = lower if upper - lower == 1 else (lower + upper - 1) / 2
                return float(min(max(middle, self.min), self.max))
        return float(self.max)

    def buckets(self) -> list[tuple[int, int, int]]:
        """Every non-empty bucket as (lower, upper exclusive, count), in order."""
        return [(*_bounds(i), c) for i, c in enumerate(self.counts) if c]

    def summary(self, scale: float = 1.0) -> dict[str, Any]:
        """count, mean, min, p50, p90, p99, p99.9 and max, each value times `scale`."""
        return {"count": self.count, "mean": self.mean * scale, "min": self.min * scale,
                "p50": self.percentile(50) * scale, "p90": self.percentile(90) * scale,
                "p99": self.percentile(99) * scale, "p99_9": self.percentile(99.9) * scale,
                "max": self.max * scale}
