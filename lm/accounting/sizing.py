"""Match a model's parameter count to a target by its MLP width (the mixers keep their papers' shapes), at a depth of
whole layer patterns."""

from dataclasses import replace

from lm.accounting.flops import param_count
from lm.model import LMConfig
from lm.util.errors import UserError


def whole_patterns(n_layers: int, pattern_length: int) -> int:
    """The depth nearest n_layers that holds whole layer patterns (at least one; halfway goes deeper): a hybrid sized
    at another model's depth keeps its mix (LMConfig refuses a cut pattern)."""
    return max(1, (2 * n_layers + pattern_length) // (2 * pattern_length)) * pattern_length


def match_params_by_mlp(cfg: LMConfig, target: int, multiple: int = 32, tolerance: float = 0.02) -> LMConfig:
    """The config with the SwiGLU hidden width (a multiple of `multiple`) whose parameter count is closest to
    `target`; a UserError when even the best is more than `tolerance` away."""
    per_unit = 3 * cfg.d_model * cfg.n_layers  # parameters per unit of MLP hidden width
    without_mlp = param_count(replace(cfg, mlp_ratio=0.0))
    hidden = max(multiple, round((target - without_mlp) / per_unit / multiple) * multiple)
    matched = replace(cfg, mlp_ratio=hidden / cfg.d_model)
    error = param_count(matched) / target - 1
    if abs(error) > tolerance:
        raise UserError(f"cannot match {target:,} parameters within {tolerance:.0%} by the MLP alone "
                        f"(best {param_count(matched):,}, {error:+.1%})")
    return matched
