"""Gated DeltaProduct (Siems et al., arXiv 2502.10297): Gated DeltaNet with n_h Householder steps per token."""

from dataclasses import dataclass, field

from lm.mixers.deltanet import GatedDeltaNet
from lm.mixers.protocol import MixerOptionError, register


@register("gated_deltaproduct")
class GatedDeltaProduct(GatedDeltaNet):
    """Gated DeltaProduct mixer (flash-linear-attention's layer): Gated DeltaNet's block with n_h = householder_steps
    keys, values and betas per token, each from its own slice of the k, v and beta projections (and its own conv
    channels), and the decay once per token (lm.ops.delta_product):

        S_{t,0} = alpha_t S_{t-1},
        S_{t,j} = (I - beta_{t,j} k_{t,j} k_{t,j}^T) S_{t,j-1} + beta_{t,j} k_{t,j} v_{t,j}^T   (j = 1 .. n_h),
        S_t = S_{t,n_h},  o_t = S_t^T q_t / sqrt(K),

    so each token's transition is alpha_t times a product of n_h generalised Householder matrices. n_h = 1 is Gated
    DeltaNet with the same weights. beta_range defaults to [0, 2], the paper's main runs (fla's allow_neg_eigval): each
    step's eigenvalue 1 - beta along its key reaches -1, which state tracking (parity, S3, S5) needs.

    Parameters: Gated DeltaNet's, with the k, v and beta projections and the k and v convs n_h times as wide:
        d_model * (HK + HV + n_h (HK + HV + n_heads) + n_heads)    q, output gate; k, v, beta; decay
      + (HK + n_h (HK + HV)) * W + V + HV * d_model + 2 n_heads     convs, norm, output projection, A_log, dt_bias
    """

    @dataclass
    class Options(GatedDeltaNet.Options):
        """Gated DeltaProduct: Gated DeltaNet with n_h delta-rule (Householder) steps per token; beta in [0, 2].

        Attributes:
            householder_steps: n_h, the delta-rule steps per token, each with its own k, v and beta (1: Gated DeltaNet)
            chunk_size (rows, n_h a token): the chunk of the chunkwise form (training): speed and memory, the same
                result to rounding; 32, faster on a CPU than Gated DeltaNet's 64 (docs/performance.md)
        """

        householder_steps: int = 2
        beta_range: list[float] = field(default_factory=lambda: [0.0, 2.0])
        chunk_size: int = 32

    op = "delta_product"

    @classmethod
    def check_options(cls, options: dict):
        o = super().check_options(options)
        if o.householder_steps < 1:
            raise MixerOptionError(f"mixer {cls.name!r} option 'householder_steps' must be 1 or more, got "
                                   f"{o.householder_steps}")
        return o

    def steps(self) -> int:
        return self.options.householder_steps
