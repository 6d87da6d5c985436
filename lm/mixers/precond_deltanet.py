"""Preconditioned Gated DeltaNet (Tumma, Loo, Rus; arXiv 2604.21100): Gated DeltaNet's delta-rule step scaled by a
diagonal preconditioner estimated online."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lm.mixers.deltanet import GatedDeltaNet, init_decay
from lm.mixers.layers import no_weight_decay
from lm.mixers.protocol import MixerOptionError, register
from lm.ops.call import OpCall
from lm.ops.common import compute_dtype


@register("precond_gated_deltanet")
class PrecondGatedDeltaNet(GatedDeltaNet):
    """Preconditioned Gated DeltaNet mixer (flash-linear-attention's PrecondGatedDeltaNet layer): Gated DeltaNet's
    block, whose op is the preconditioned gated delta rule (lm.ops.precond_delta_rule). A second gated state over the
    keys, one per key channel and head, tracks the keys' recent energy,

        A_t = alpha^A_t A_{t-1} + beta^A_t k_t^2,
        M_t = exp(-log(squash) s(log(A_t + eps) - c)),    s(r) = r / (1 + |r|),

    with its own gates as Gated DeltaNet's: beta^A_t = sigmoid(W_b^A x_t), alpha^A_t = exp(-exp(A_log^A)
    softplus(W_a^A x_t + dt_bias^A)) per head, and a learnt center c per head (fla's log_atk_scale, starting at
    center_init). The delta-rule step writes along the preconditioned key M_t * k_t:

        S_t = (I - beta_t (M_t * k_t) k_t^T) alpha_t S_{t-1} + beta_t (M_t * k_t) v_t^T,    o_t = S_t^T q_t / sqrt(K).

    M_t lies in (1/squash, squash) (squash <= 2 keeps the transition stable, fla's note). The state is the pair
    (S, A); a reset clears both.

    Parameters: Gated DeltaNet's, plus d_model * 2 n_heads (W_a^A, W_b^A) + 3 n_heads (A_log^A, dt_bias^A, c).
    """

    @dataclass
    class Options(GatedDeltaNet.Options):
        """Preconditioned Gated DeltaNet: Gated DeltaNet's step along the key scaled by a diagonal preconditioner.

        Attributes:
            squash: the preconditioner M_t lies in (1/squash, squash); 1 < squash <= 2 (2 and below keep it stable)
            squash_eps: eps in log(A_t + eps), A_t the keys' recent energy that sets M_t
            center_init: the learnt center c of log(A_t + eps) at init, per head (M_t is 1 where they meet)
        """

        squash: float = 1.5
        squash_eps: float = 1e-6
        center_init: float = -0.2

    @classmethod
    def check_options(cls, options: dict):
        o = super().check_options(options)
        if not 1 < o.squash <= 2 or o.squash_eps <= 0:
            raise MixerOptionError(f"mixer {cls.name!r} needs 1 < squash <= 2 and squash_eps > 0, got squash "
                                   f"{o.squash} and squash_eps {o.squash_eps}")
        return o

    def __init__(self, d_model: int, n_heads: int, head_dim: int, layer_idx: int = 0, **options):
        super().__init__(d_model, n_heads, head_dim, layer_idx, **options)
        self.precond_a_proj = nn.Linear(d_model, n_heads, bias=False)
        self.precond_b_proj = nn.Linear(d_model, n_heads, bias=False)
        self.precond_A_log = nn.Parameter(torch.empty(n_heads))
        self.precond_dt_bias = nn.Parameter(torch.empty(n_heads))
        self.precond_center = nn.Parameter(torch.empty(n_heads))
        no_weight_decay(self.precond_A_log, self.precond_dt_bias, self.precond_center, self.precond_a_proj.weight,
                        self.precond_b_proj.weight)
        self.reset_mixer_parameters()

    def reset_mixer_parameters(self):
        super().reset_mixer_parameters()
        if hasattr(self, "precond_center"):  # Gated DeltaNet's constructor calls this before they exist
            init_decay(self.precond_A_log, self.precond_dt_bias)
            with torch.no_grad():
                self.precond_center.fill_(self.options.center_init)

    def op_inputs(self, x: torch.Tensor, state: dict, reset: torch.Tensor | None) -> OpCall:
        """Gated DeltaNet's inputs and the preconditioner's gates, for the preconditioned op."""
        call = super().op_inputs(x, state, reset)
        q, k, v, beta, log_alpha, scale = call.args
        dtype = compute_dtype(x)
        beta_a = torch.sigmoid(self.precond_b_proj(x).to(dtype))
        log_alpha_a = -torch.exp(self.precond_A_log.to(dtype)) * F.softplus(
            self.precond_a_proj(x).to(dtype) + self.precond_dt_bias.to(dtype))
        options = {"squash": self.options.squash, "eps": self.options.squash_eps,
                   "center": self.precond_center.to(dtype), **call.options}
        return OpCall("precond_delta_rule", (q, k, v, beta, log_alpha, beta_a, log_alpha_a, scale), options,
                      state=call.state)
