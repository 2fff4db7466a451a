"""A KV link's measured speed: latency and bandwidth, from what its real transfers cost after
their prefill finished, for the router's placement cost model (router/placement/cost_model.py).

The prefill side's KVSender (sender.py) hands each transfer's pages to the transport as its
chunks complete, so most bytes leave while later chunks compute; what a request pays for the
link is the tail: the bytes still in flight when its prefill is done, and how long the
transport then takes to get them out (the `flush` in `finish`). Each tail is a sample
(bytes, seconds); the meter fits seconds = latency + bytes / bandwidth by least squares over
the samples, each older one weighted down by `decay`, so the figures follow the link as it is
now. With samples too alike in size to tell the two apart, bandwidth is total bytes over total
time and latency the smallest tail seen.
"""

from __future__ import annotations

DECAY = 0.9  # weight kept by the earlier samples at each new one
MIN_SPREAD_BYTES = 64 << 10  # tails this close in size cannot separate latency from bandwidth


class LinkMeter:
    def __init__(self, decay: float = DECAY) -> None:
        self.decay = decay
        self.num_samples = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0  # decayed sums over (bytes, seconds)
        self._min_s = float("inf")
        self._min_bytes = self._max_bytes = 0.0

    def add(self, num_bytes: int, seconds: float) -> None:
        if seconds < 0 or num_bytes < 0:
            return
        d = self.decay
        x, y = float(num_bytes), seconds
        self._w, self._x, self._y = d * self._w + 1, d * self._x + x, d * self._y + y
        self._xx, self._xy = d * self._xx + x * x, d * self._xy + x * y
        self._min_s = min(self._min_s, seconds)
        self._min_bytes = x if self.num_samples == 0 else min(self._min_bytes, x)
        self._max_bytes = max(self._max_bytes, x)
        self.num_samples += 1

    @property
    def latency_s(self) -> float:
        """Seconds a tail costs whatever its size; 0 before any sample."""
        fit = self._fit()
        return fit[0] if fit else (self._min_s if self.num_samples else 0.0)

    @property
    def bytes_per_s(self) -> float:
        """Bytes per second past the latency; 0 before a sample with bytes in it."""
        fit = self._fit()
        if fit:
            return fit[1]
        return self._x / self._y if self._x > 0 and self._y > 0 else 0.0

    def _fit(self) -> tuple[float, float] | None:
        """(latency, bandwidth) by weighted least squares, when the samples allow one."""
        if self.num_samples < 3 or self._max_bytes - self._min_bytes < MIN_SPREAD_BYTES:
            return None
        var = self._w * self._xx - self._x * self._x
        if var <= 0:
            return None
        slope = (self._w * self._xy - self._x * self._y) / var  # seconds per byte
        intercept = (self._y - slope * self._x) / self._w
        if slope <= 0:
            return None
        return max(0.0, intercept), 1.0 / slope
