"""The Mesa layer (von Oswald et al., 2025, "MesaNet"): at every step the optimal linear readout of an
in-context ridge regression, o_t = G_t (H_t + Lambda)^{-1} q_t, solved by conjugate gradient."""

import math
import typing
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lm.mixers.layers import Gain, GatedRMSNorm, ShortConv, no_weight_decay, own_init, residual_output
from lm.mixers.protocol import Mixer, MixerOptionError, register
from lm.ops.call import OpCall
from lm.ops.common import compute_dtype

GammaInit = typing.Literal["narrow", "zero", "spread"]


def gamma_bias(init: str, n_heads: int) -> torch.Tensor:
    """Gate biases b per head, gamma = sigmoid(b) at a zero input, for the memory lengths m = 1 / (1 - gamma) that
    `init` names (see Mesa)."""
    if init == "narrow":
        return torch.linspace(3.0, 6.0, n_heads)
    if init == "zero":
        return torch.zeros(n_heads)
    memory = torch.logspace(1.0, 9.0, n_heads, base=2.0) if n_heads > 1 else torch.tensor([2.0**5])
    return torch.log(memory - 1.0)  # logit(1 - 1/m)


@register("mesa")
class Mesa(Mixer):
    """Mesa mixer. q, k, v projections; a short causal conv + SiLU on q and k (and on v with conv_v); q and k
    L2-normalised per head; beta = sigmoid(W_beta x + b) and gamma = sigmoid(W_gamma x + b) per head, with the
    gamma cap gamma * (1 - (1 - gamma_cap) * beta^2) against runs of repeated tokens; Lambda = lam_floor +
    softplus(lam_raw) per head and key dim, initialised to lam_init (1); the Mesa op (lm.ops.mesa, CG with cg_steps in
    training and cg_steps_eval in evaluation); a per-head RMSNorm (its weight initialised to norm_init), times
    silu(W_g x) with output_gate; the output projection. conv_size 0, qk_norm false and output_norm false leave out
    the convs, the L2 normalisation and the RMSNorm (with output_gate, the gate stays). `metrics()` reports the last
    call's solve (and, after a backward, its adjoint solve), Lambda, gamma and beta.

    gamma_init sets the gate biases, i.e. each head's memory 1 / (1 - gamma) at the start: "spread" (the default,
    chosen by `lm research mesa-ablation`, docs/mesa.md), log-spaced from 2 to 512 tokens across heads; "narrow", 20 to
    400 tokens (sigmoid(3) to sigmoid(6), xLSTM's forget-gate range, the default before); "zero", 2 tokens in every
    head (bias 0, as fla's MesaNet).

    norm_init 0.125 (chosen by `lm research mesa-ablation`, docs/mesa.md; the paper does not say, and 1 is the usual
    init) starts the RMSNorm's output, unit RMS per head at every position, at the scale a gated or unnormalised
    mixer output has at init: with 1, Mesa's residual branch starts about 7x larger than Gated DeltaNet's.

    Key size K = head_dim, value size V = expand_v * head_dim per head.

    Parameters, with HK = n_heads * K, HV = n_heads * V, W = conv_size:
        d_model * (2 HK + HV)            q, k, v
      + 2 (d_model * n_heads + n_heads)  beta and gamma gates (with biases)
      + 2 HK * W (+ HV * W with conv_v)  convs
      + HK                               Lambda
      + V                                output norm
      (+ d_model * HV with output_gate)  output gate
      + HV * d_model                     output projection
    """

    @dataclass
    class Options:
        """Mesa layer: o_t = G_t (H_t + Lambda)^-1 q_t, an in-context ridge regression solved by conjugate gradient.

        Attributes:
            expand_v (x head_dim): value size per head, V = expand_v * head_dim (the keys have head_dim)
            conv_size (tokens): width of the short causal convs + SiLU on q and k (and v with conv_v); 0: none
            conv_v: a short causal conv + SiLU on v as well
            qk_norm: L2-normalise q and k per head
            output_norm: a per-head RMSNorm on the op's output (its weight from norm_init); false: the weight alone
            cg_steps: most CG steps per token in training (0: gated linear attention read out with q)
            cg_steps_eval: most CG steps per token in evaluation and decoding; null: cg_steps
            cg_tol: relative residual at which a token's solve stops early; null: always the full steps
            lam_floor: the floor of Lambda = lam_floor + softplus(.), per head and key channel
            lam_init: Lambda at init, per head and key channel (above lam_floor)
            gamma_cap: the forget gate capped as gamma (1 - (1 - gamma_cap) beta^2), against runs of repeated tokens;
                null: no cap
            output_gate: the normed output times silu(W_g x)
            gamma_init: the forget gate's biases at init, each head's memory 1 / (1 - gamma): spread (2 to 512 tokens
                across heads), narrow (20 to 400) or zero (2 in every head)
            norm_init: the output RMSNorm's weight at init (lm research mesa-ablation, docs/mesa.md)
            chunk_size (tokens): the chunk of the chunkwise form (training): speed and memory, the same result to
                rounding
            backend: what computes the op: auto (lm's Triton kernels on CUDA where they take the head sizes, else
                torch), torch, triton or fla (fla's solver, another algorithm: only by name)
        """

        expand_v: float = 1.0
        conv_size: int = 4
        conv_v: bool = False
        qk_norm: bool = True
        output_norm: bool = True
        cg_steps: int = 30
        cg_steps_eval: int | None = None
        cg_tol: float | None = None
        lam_floor: float = 0.25
        lam_init: float = 1.0
        gamma_cap: float | None = 0.9975
        output_gate: bool = False
        gamma_init: GammaInit = "spread"
        norm_init: float = 0.125
        chunk_size: int = 64
        backend: str = "auto"

    @classmethod
    def check_options(cls, options: dict) -> "Mesa.Options":
        o = super().check_options(options)
        if not o.lam_init > o.lam_floor:  # Lambda = lam_floor + softplus(.) never reaches its floor
            raise MixerOptionError(f"mixer 'mesa' option 'lam_init' must exceed lam_floor ({o.lam_floor}), "
                                   f"got {o.lam_init}")
        return o

    def __init__(self, d_model: int, n_heads: int, head_dim: int, layer_idx: int = 0, **options):
        super().__init__(d_model, n_heads, head_dim, layer_idx, **options)
        o = self.options  # the one source of every option
        self.key_dim, self.value_dim = head_dim, int(round(o.expand_v * head_dim))
        conv_size, conv_v, output_gate = o.conv_size, o.conv_v, o.output_gate
        hk, hv = n_heads * self.key_dim, n_heads * self.value_dim
        self.q_proj = nn.Linear(d_model, hk, bias=False)
        self.k_proj = nn.Linear(d_model, hk, bias=False)
        self.v_proj = nn.Linear(d_model, hv, bias=False)
        self.beta_proj = nn.Linear(d_model, n_heads)
        self.gamma_proj = nn.Linear(d_model, n_heads)
        self.q_conv, self.k_conv = ShortConv(hk, conv_size), ShortConv(hk, conv_size)
        self.v_conv = ShortConv(hv, conv_size) if conv_v else None
        self.lam_raw = nn.Parameter(torch.empty(n_heads, self.key_dim))
        if output_gate:
            self.norm = GatedRMSNorm(self.value_dim, normalize=o.output_norm)
        else:  # with output_norm false, the weight alone (a per-channel gain, same parameters)
            self.norm = nn.RMSNorm(self.value_dim, eps=1e-6) if o.output_norm else Gain(self.value_dim)
        self.g_proj = nn.Linear(d_model, hv, bias=False) if output_gate else None
        self.out_proj = residual_output(nn.Linear(hv, d_model, bias=False))
        no_weight_decay(self.lam_raw, self.beta_proj.weight, self.gamma_proj.weight)
        own_init(self.beta_proj.bias, self.gamma_proj.bias)  # the model's init leaves the gate biases to this one
        self.reset_mixer_parameters()

    def reset_mixer_parameters(self):
        """Lambda starts at lam_init and beta at 0.5, gamma as gamma_init says, the output RMSNorm's weight at
        norm_init. Once, from the constructor."""
        o = self.options
        with torch.no_grad():
            self.lam_raw.fill_(math.log(math.expm1(o.lam_init - o.lam_floor)))
            if o.output_norm:  # the RMSNorm sets every head's output to unit RMS; without it, no rescaling
                self.norm.weight.fill_(o.norm_init)
            self.gamma_proj.bias.copy_(gamma_bias(o.gamma_init, self.n_heads))
            self.beta_proj.bias.zero_()

    def lam(self) -> torch.Tensor:
        return self.options.lam_floor + F.softplus(self.lam_raw)

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log gamma, beta), [B, T, H] in fp32, the cap applied in log space."""
        dtype = compute_dtype(x)
        beta_pre, gamma_pre = self.beta_proj(x).to(dtype), self.gamma_proj(x).to(dtype)
        beta = torch.sigmoid(beta_pre)
        return self.capped(F.logsigmoid(gamma_pre), beta), beta

    def capped(self, log_gamma: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """log(gamma * (1 - (1 - gamma_cap) * beta^2)): the cap against runs of repeated tokens (none without one)."""
        cap = self.options.gamma_cap
        return log_gamma if cap is None else log_gamma + torch.log1p(-(1 - cap) * beta**2)

    def op_inputs(self, x: torch.Tensor, state: dict, reset: torch.Tensor | None) -> OpCall:
        """The Mesa op on (q, k, v, log gamma, beta, Lambda), at cg_steps in training and cg_steps_eval in
        evaluation; with its telemetry (return_info) but on fla's kernel, which reports nothing."""
        B, T, _ = x.shape
        q, q_state = self.q_conv(self.q_proj(x), state.get("q_conv"), reset)
        k, k_state = self.k_conv(self.k_proj(x), state.get("k_conv"), reset)
        v, v_state = self.v_proj(x), None
        if self.v_conv is not None:
            v, v_state = self.v_conv(v, state.get("v_conv"), reset)
        q, k = q.view(B, T, self.n_heads, self.key_dim), k.view(B, T, self.n_heads, self.key_dim)
        if self.options.qk_norm:
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        v = v.view(B, T, self.n_heads, self.value_dim)
        o = self.options
        steps = o.cg_steps if self.training or o.cg_steps_eval is None else o.cg_steps_eval
        options = {"cg_steps": steps, "cg_tol": o.cg_tol, "chunk_size": o.chunk_size, "backend": o.backend,
                   "return_info": o.backend != "fla"}
        args = (q, k, v, *self.gates(x), self.lam().to(compute_dtype(x)))
        return OpCall("mesa", args, options, state={"q_conv": q_state, "k_conv": k_state, "v_conv": v_state})

    def op_output(self, x: torch.Tensor, out: torch.Tensor, call: OpCall) -> torch.Tensor:
        """The per-head norm (gated with output_gate) and the output projection; the gates' statistics join the op's
        telemetry for `metrics`."""
        B, T, _ = x.shape
        _, _, _, log_gamma, beta, lam = call.args
        with torch.no_grad():
            self.op_info.update(lambda_min=lam.min(), lambda_mean=lam.mean(), gamma_mean=log_gamma.exp().mean(),
                                beta_mean=beta.mean())
        o = self.norm(out, self.g_proj(x).view(B, T, self.n_heads, -1)) if self.g_proj is not None else self.norm(out)
        return self.out_proj(o.reshape(B, T, -1))

    def metrics(self) -> dict[str, torch.Tensor]:
        """The last call's statistics as 0-dim tensors (nothing is synced to the host here): the CG solve
        (cg_iterations, cg_residual and cg_residual_max, the true relative residual), the adjoint solve's after a
        backward (cg_adjoint_*), Lambda (min, mean), gamma and beta (mean), and max diag(H_t) / min Lambda."""
        return {key if key.startswith(("lambda", "gamma", "beta")) else "cg_" + key: value
                for key, value in self.op_info.items()}
