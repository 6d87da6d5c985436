"""Float64 references of every registered mixer's forward, written from its paper's equations, one module per mixer.

Each module here registers its mixer's reference with `@reference("name", variants=[...])`:

    forward(mixer, x, state, reset) -> (y, state)

x [B, T, D] float64; state None (empty) or what this reference returned for the tokens before; reset None or [B, T]
bool (True: the state is cleared before that token). It loops over the tokens one at a time and applies the paper's
equations with plain torch arithmetic to the mixer's own parameters (`mixer.q_proj.weight`, ...): it calls neither
`lm.ops`, nor the mixer's `forward`, nor the forward of any of its submodules (convolutions, norms and gates are written
out), so that a change to the mixer's math is a difference from it. The state is the reference's own (a dict of the
recurrence's variables per batch row); it need not look like the mixer's.

`variants`: option dicts the test builds the mixer with (the defaults, and options that change the math: convs,
norms, gates, windows), each with a chunk size small enough that the test's lengths span several chunks.
tests/test_mixer_math.py runs every variant of every registered mixer against its reference; a registered mixer
without one fails there.
"""

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Reference:
    forward: Callable
    variants: list[dict] = field(default_factory=lambda: [{}])
    atol: float = 1e-9  # Mesa's solve is CG in the mixer, an exact solve here
    prepare: Callable | None = None  # prepare(mixer) after the test's perturbation: move what an init would hide


REFERENCES: dict[str, Reference] = {}


def reference(name: str, variants: list[dict] | None = None, atol: float = 1e-9, prepare: Callable | None = None):
    def add(fn):
        REFERENCES[name] = Reference(fn, variants or [{}], atol, prepare)
        return fn

    return add


for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
