"""Which source each position of a mixture's training stream reads, so that every source's share of the windows
matches its weight at every point of a run, with random access (a resume at any position) and no state.

The weights are rounded to integer rates a_s that sum to PERIOD (2^16). Every PERIOD positions of the stream
repeat one pattern: source s's k-th window of the pattern sits at the key (k + 1/2) / a_s, and the pattern is all
the keys in increasing order (ties to the lower source). Among the first P positions a source then has P a_s / PERIOD
windows within about two, whatever P is, so a short run and every global batch are mixed as the weights say.
Position p reads the n-th window of its source, n counting that source's earlier positions; the source's own
seeded order (lm.training.data) says which window that is.
"""

import numpy as np

from lm.util.errors import UserError

PERIOD = 2**16


def rates(weights: list[float]) -> np.ndarray:
    """Integer rates summing to PERIOD, proportional to `weights` (largest remainders get the leftover units)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * PERIOD
    a = np.floor(exact).astype(np.int64)
    leftover = PERIOD - int(a.sum())
    a[np.argsort(-(exact - a), kind="stable")[:leftover]] += 1
    if (a == 0).any():
        raise UserError(f"data.sources: a weight below 1/{PERIOD} of the total cannot be drawn; drop that source or "
                        "raise its weight")
    return a


class MixtureSchedule:
    """Positions of the training stream -> (source, index among that source's positions)."""

    def __init__(self, weights: list[float]):
        self.rates = rates(weights)
        keys = np.concatenate([(np.arange(a) + 0.5) / a for a in self.rates])
        labels = np.repeat(np.arange(len(self.rates)), self.rates)
        # Distinct keys differ by at least 1 / (4 a_s a_t) >= 2^-34: float64 orders them exactly.
        self.pattern = labels[np.lexsort((labels, keys))].astype(np.int16)
        # Index of each pattern slot among its own source's slots.
        self.rank = np.empty(PERIOD, dtype=np.int64)
        for s in range(len(self.rates)):
            self.rank[self.pattern == s] = np.arange(self.rates[s])

    @property
    def shares(self) -> np.ndarray:
        """Each source's share of the positions (its weight, rounded to 1/PERIOD)."""
        return self.rates / PERIOD

    def locate(self, position: int) -> tuple[int, int]:
        """(source, n): position `position` reads its source's n-th window."""
        cycle, slot = divmod(position, PERIOD)
        source = int(self.pattern[slot])
        return source, cycle * int(self.rates[source]) + int(self.rank[slot])

    def counts(self, positions: int) -> np.ndarray:
        """Windows of each source among the first `positions` positions."""
        cycle, slot = divmod(positions, PERIOD)
        return cycle * self.rates + np.bincount(self.pattern[:slot], minlength=len(self.rates))
