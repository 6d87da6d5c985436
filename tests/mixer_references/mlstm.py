"""mLSTM of xLSTM 7B (Beck et al., 2025), token by token in float64 from the mixer's own parameters.

Per head, with q^ = q / sqrt(K), f_t = sigmoid(f~_t), i_t = exp(i~_t) and gate pre-activations soft-capped,
i~ = cap tanh(W_i x / cap) (likewise f~), the cell kept stabilised by the running maximum m_t of log-gates:

    m_t  = max(log f_t + m_{t-1}, i~_t)                         (a stabiliser only: no gradient through it)
    C~_t = exp(log f_t + m_{t-1} - m_t) C~_{t-1} + exp(i~_t - m_t) k_t v_t^T
    n~_t = exp(log f_t + m_{t-1} - m_t) n~_{t-1} + exp(i~_t - m_t) k_t
    h_t  = C~_t^T q^_t / (max(|n~_t^T q^_t|, exp(-m_t)) + eps)

i.e. C_t^T q^_t / (max(|n_t^T q^_t|, 1) + eps exp(m_t)) in terms of the unstabilised C = C~ exp(m), n = n~ exp(m);
the empty state is (0, 0, 0). Then a per-head RMSNorm (output_norm), the norm weight, the output gate
sigmoid(W_o x) and the output projection. conv_size > 0: q and k are read from SiLU(causal depthwise conv(x)).
"""

import math

import torch

from . import reference
from .elementwise import cleared, conv_step, logsigmoid, rms_normalise

CHUNK = {"chunk_size": 4}


def _softcap(x, cap):
    return x if cap is None else cap * torch.tanh(x / cap)


def _zero_state(mixer, x):
    B, D, H = x.shape[0], x.shape[2], mixer.n_heads
    K, V = mixer.qk_head, mixer.v_head
    state = {"C": x.new_zeros(B, H, K, V), "n": x.new_zeros(B, H, K), "m": x.new_zeros(B, H)}
    if mixer.conv is not None:
        state["conv"] = x.new_zeros(B, mixer.conv.size - 1, D)
    return state


def prepare(mixer):
    """Input-gate biases of -10 (the init) keep |n^T q^| far below 1, so the normaliser's max would never pick n:
    spread them across heads (about -10, 0 and 2) so that both sides of the max are met."""
    with torch.no_grad():
        mixer.igate.bias.copy_(torch.linspace(-10.0, 2.0, mixer.n_heads) + 0.2 * torch.randn(mixer.n_heads))


@reference("mlstm", variants=[CHUNK, {**CHUNK, "conv_size": 4}, {**CHUNK, "output_norm": False},
                              {**CHUNK, "gate_soft_cap": None}], atol=1e-9, prepare=prepare)
def forward(mixer, x, state, reset):
    B, T, D = x.shape
    H, K, V = mixer.n_heads, mixer.qk_head, mixer.v_head
    cap, eps = mixer.options.gate_soft_cap, mixer.options.eps
    state = dict(state) if state is not None else _zero_state(mixer, x)
    outputs = []
    for t in range(T):
        x_t = x[:, t]  # [B, D]
        state = cleared(state, None if reset is None else reset[:, t])
        qk_in = x_t
        if mixer.conv is not None:
            qk_in, state["conv"] = conv_step(state["conv"], x_t, mixer.conv.weight)
        q = (qk_in @ mixer.q_proj.weight.T).view(B, H, K) / math.sqrt(K)
        k = (qk_in @ mixer.k_proj.weight.T).view(B, H, K)
        v = (x_t @ mixer.v_proj.weight.T).view(B, H, V)
        i_pre = _softcap(x_t @ mixer.igate.weight.T + mixer.igate.bias, cap)  # [B, H]
        log_f = logsigmoid(_softcap(x_t @ mixer.fgate.weight.T + mixer.fgate.bias, cap))
        m_prev = state["m"]
        m = torch.maximum(log_f + m_prev, i_pre).detach()
        decay, write = torch.exp(log_f + m_prev - m), torch.exp(i_pre - m)
        C = decay[..., None, None] * state["C"] + write[..., None, None] * k[..., :, None] * v[..., None, :]
        n = decay[..., None] * state["n"] + write[..., None] * k
        state.update(C=C, n=n, m=m)
        num = (C * q[..., None]).sum(-2)  # C^T q^  [B, H, V]
        den = torch.maximum((n * q).sum(-1).abs(), torch.exp(-m)) + eps
        h = num / den[..., None]
        if mixer.options.output_norm:
            h = rms_normalise(h, 1e-6)
        h = h.reshape(B, H * V) * mixer.norm_weight * torch.sigmoid(x_t @ mixer.ogate.weight.T)
        outputs.append(h @ mixer.out_proj.weight.T)
    return torch.stack(outputs, 1), state
