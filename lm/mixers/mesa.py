"""The Mesa layer (von Oswald et al., 2025, "MesaNet"): at every step the optimal linear readout of an
in-context ridge regression, o_t = G_t (H_t + Lambda)^{-1} q_t, solved by conjugate gradient."""

import dataclasses
import math
import typing
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lm.mixers.layers import Gain, GatedRMSNorm, ShortConv, no_weight_decay, own_init, residual_output
from lm.mixers.protocol import Mixer, MixerOptionError, OpCall, register
from lm.ops import mesa, mesa_recurrent
from lm.ops.common import compute_dtype, effective_chunk_size
from lm.ops.flops import mesa_cg_step_flops, mesa_op_flops, mesa_op_train_flops, padding_factor
from lm.ops.state_transfer import carry_decayed, piece_log_decay

GammaInit = typing.Literal["narrow", "zero", "spread"]
# Plans only (`expected_cg_steps`): the factor by which CG's relative residual is taken to fall per step. On the
# inputs of docs/performance.md ("Mesa: CG steps and cost") 1e-4 took about 6 steps (0.2 a step); docs/mesa.md sets
# it against what the CPU ladder's runs spent.
PLANNED_CG_RATE = 0.2


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
        self._metrics: dict[str, torch.Tensor] = {}
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

    def op_inputs(self, x: torch.Tensor, state: dict, reset: torch.Tensor | None):
        """(q, k, v, log gamma, beta) for the op, and the convs' new states (a dict)."""
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
        return q, k, v, *self.gates(x), {"q_conv": q_state, "k_conv": k_state, "v_conv": v_state}

    def forward(self, x: torch.Tensor, state: dict | None = None, reset: torch.Tensor | None = None):
        B, T, _ = x.shape
        state = state or {}
        q, k, v, log_gamma, beta, new_state = self.op_inputs(x, state, reset)
        opt = self.options
        steps = opt.cg_steps if self.training or opt.cg_steps_eval is None else opt.cg_steps_eval
        lam = self.lam().to(compute_dtype(x))
        if T == 1 and "memory" in state:
            o, memory, info = mesa_recurrent(q, k, v, log_gamma, beta, lam, cg_steps=steps, cg_tol=opt.cg_tol,
                                             initial_state=state["memory"], reset=reset, return_info=True)
        else:
            reports = opt.backend != "fla"  # fla's kernel reports nothing
            o, memory, *info = mesa(q, k, v, log_gamma, beta, lam, cg_steps=steps, cg_tol=opt.cg_tol,
                                    initial_state=state.get("memory"), reset=reset, chunk_size=opt.chunk_size,
                                    return_info=reports, backend=opt.backend)
            info = info[0] if reports else {}
        with torch.no_grad():
            info.update(lambda_min=lam.min(), lambda_mean=lam.mean(), gamma_mean=log_gamma.exp().mean(),
                        beta_mean=beta.mean())
        self._metrics = info  # the op's dict: a backward through this call adds the adjoint solve's entries to it
        o = self.norm(o, self.g_proj(x).view(B, T, self.n_heads, -1)) if self.g_proj is not None else self.norm(o)
        new_state["memory"] = memory
        return self.out_proj(o.reshape(B, T, -1)), new_state

    carried = "memory"

    def piece_transfer(self, x: torch.Tensor, state: dict, reset: torch.Tensor | None):
        """G and H from zero need no solve: the op with 0 CG steps (gated linear attention) ends with them."""
        q, k, v, log_gamma, beta, _ = self.op_inputs(x, state, reset)
        _, final = mesa(q, k, v, log_gamma, beta, self.lam().to(compute_dtype(x)), cg_steps=0, reset=reset,
                        chunk_size=self.options.chunk_size)
        return final, piece_log_decay(log_gamma, reset)

    carry = staticmethod(carry_decayed)

    def metrics(self) -> dict[str, torch.Tensor]:
        """The last call's statistics as 0-dim tensors (nothing is synced to the host here): the CG solve
        (cg_iterations, cg_residual and cg_residual_max, the true relative residual), the adjoint solve's after a
        backward (cg_adjoint_*), Lambda (min, mean), gamma and beta (mean), and max diag(H_t) / min Lambda."""
        return {key if key.startswith(("lambda", "gamma", "beta")) else "cg_" + key: value
                for key, value in self._metrics.items()}

    def flops_spent_per_token(self, seq_len: int, training: bool) -> float:
        """The last call as it ran: at the steps it was set to (cg_steps_eval in evaluation), and with cg_tol at the CG
        steps its telemetry says the code ran (`iterations_run`, forward and, training, adjoint; lm.ops.mesa counts a
        loop as running until its last token has converged) instead of the most. A fixed-step call is the
        analytic count, with no read of the telemetry (no device sync)."""
        o = self.options
        steps = o.cg_steps if training or o.cg_steps_eval is None else o.cg_steps_eval
        shape = (self.d_model, self.n_heads, self.head_dim)
        at_steps = {**dataclasses.asdict(o), "cg_steps": steps, "cg_tol": None}  # the analytic count at `steps`
        counted = self.flops_per_token(*shape, seq_len, training, **at_steps)
        ran = self._metrics.get("iterations_run")
        if steps == 0 or o.cg_tol is None or ran is None:
            return counted
        extra = float(ran) - steps
        if training:
            extra += float(self._metrics.get("adjoint_iterations_run", steps)) - steps
        return counted + extra * self.cg_step_flops_per_token(*shape, seq_len, **dataclasses.asdict(o))

    @classmethod
    def cg_step_flops_per_token(cls, d_model, n_heads, head_dim, seq_len, **options) -> float:
        """One CG step of one solve, per token, all heads (lm.ops.flops.mesa_cg_step_flops on the padded chunks)."""
        chunk = effective_chunk_size(cls.check_options(options).chunk_size, seq_len)
        return n_heads * padding_factor(seq_len, chunk) * mesa_cg_step_flops(chunk, head_dim)

    @staticmethod
    def expected_cg_steps(cg_steps: int, cg_tol: float | None) -> int:
        """The CG steps a plan charges: cg_steps, or with cg_tol the steps at which a residual falling by
        PLANNED_CG_RATE per step reaches cg_tol (at most cg_steps). An estimate; a run counts what it ran."""
        if cg_tol is None or cg_steps == 0:
            return cg_steps
        return min(cg_steps, max(1, math.ceil(math.log(cg_tol) / math.log(PLANNED_CG_RATE))))

    @classmethod
    def flops_note(cls, **options) -> str | None:
        o = cls.check_options(options)
        if o.cg_tol is None or o.cg_steps == 0:
            return None
        return (f"mesa with cg_tol {o.cg_tol:g} is planned at {cls.expected_cg_steps(o.cg_steps, o.cg_tol)} expected "
                f"CG steps of at most {o.cg_steps} (a residual falling {PLANNED_CG_RATE:g}x a step); its runs log the "
                f"steps they ran (train/flops)")

    @classmethod
    def op_flops_per_token(cls, d_model, n_heads, head_dim, seq_len, training, **options) -> float:
        """The Mesa op at the training CG steps (lm.ops.flops); with cg_tol at `expected_cg_steps`, a plan's estimate
        (what a run spent is `flops_spent_per_token`)."""
        o = cls.check_options(options)
        chunk = effective_chunk_size(o.chunk_size, seq_len)
        v = int(round(o.expand_v * head_dim))
        per_head = padding_factor(seq_len, chunk) * (mesa_op_train_flops if training else mesa_op_flops)(
            chunk, head_dim, v, cls.expected_cg_steps(o.cg_steps, o.cg_tol))
        if o.cg_steps == 0:
            per_head += 2 * head_dim * head_dim  # H_T is still carried: one product, no backward (no loss reads it)
        return n_heads * per_head

    @classmethod
    def workspace_bytes_per_token(cls, d_model, n_heads, head_dim, **options) -> float:
        """The CG solve's buffers, float32 whatever the precision: per token and head the chunked keys (K), the decay
        weights of its chunk (C), its share of the chunk's entering key state (K^2 / C), and about ten K-vectors of
        CG and its matrix-vector products (x, r, p, A p, b, the Jacobi diagonal and their temporaries)."""
        C, K = cls.check_options(options).chunk_size, head_dim
        return 4 * n_heads * (2 * C + K * K / C + 10 * K)

    @torch.no_grad()
    def bench_op(self, batch: int, T: int) -> OpCall:
        randn = lambda *dims: torch.randn(batch, T, self.n_heads, *dims)  # [B, T, H, *]
        K, V = self.key_dim, self.value_dim
        q, k = F.normalize(randn(K), dim=-1), F.normalize(randn(K), dim=-1)  # the mixer L2-normalises both
        beta = torch.sigmoid(randn() + self.beta_proj.bias)  # bias 0
        log_gamma = self.capped(F.logsigmoid(randn() + self.gamma_proj.bias), beta)  # the biases of its gamma_init
        args = [q, k, randn(V), log_gamma, beta, self.lam().clone()]  # lam [H, K], 1 at init
        # return_info: the true residual costs one more matvec per solve; the mixer always asks for it, as here.
        return OpCall("mesa", mesa, mesa_recurrent, args, (batch, T, self.n_heads, V),
                      {"cg_steps": self.options.cg_steps, "cg_tol": self.options.cg_tol, "return_info": True})
