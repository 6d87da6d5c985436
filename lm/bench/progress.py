"""What a benchmark says while it runs: a tqdm bar on stderr that names the run under way (a model, a length, a
strategy...) and, where a run has them, its groups of steps (warm-up, timed), so that a long `lm bench` shows it is
moving from its start rather than after its last run. Results stay on stdout, the bar's lines on stderr."""

import sys
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

Item = TypeVar("Item")


def bench_bar(total: int, what: str, unit: str = "step") -> tqdm:
    """A bar of `total` units on stderr. miniters=1: tqdm's default adapts how many updates it skips to the first
    ones, and would keep quiet through slow steps that follow fast ones."""
    return tqdm(total=total, desc=what, unit=unit, file=sys.stderr, miniters=1, dynamic_ncols=True)


def each_run(items: Iterable[Item], what: str, name: Callable[[Item], str] = str) -> Iterator[Item]:
    """Each of `items` in turn, with a bar that counts the runs done and names the one under way."""
    items = list(items)
    with bench_bar(len(items), what, unit="run") as bar:
        for item in items:
            bar.set_description(f"{what}: {name(item)}")  # redraws at once: a line as each run starts
            yield item
            bar.update()


class Parts:
    """A bar over a command's parts that run one after another rather than in a loop: `start(name)` as each begins,
    `close()` after the last."""

    def __init__(self, what: str, count: int):
        self.what, self.bar, self.started = what, bench_bar(count, what, unit="part"), False

    def start(self, name: str) -> None:
        if self.started:
            self.bar.update()  # the part before is done
        self.started = True
        self.bar.set_description(f"{self.what}: {name}")

    def close(self) -> None:
        self.bar.update(self.bar.total - self.bar.n)
        self.bar.close()
