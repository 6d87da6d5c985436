"""Why mlstm_kernels' Triton mLSTM (`chunkwise--triton_xl_chunk`) gives other gradients than lm's op: its backward
treats the normaliser max(|n_t . q^_t|, exp(-m_t)) as a constant.

The kernel's output agrees with lm's; its dv agrees too, since v does not enter the normaliser. Its dq, dk, di and df
(the inputs that do) differ. They equal, to float32 rounding, the gradients of the same layer with the normaliser
detached from autograd, computed here by a float64 recurrence of the unstabilised layer:

    C_t = f_t C_{t-1} + exp(i_t) k_t v_t^T,  n_t = f_t n_{t-1} + exp(i_t) k_t,  f_t = sigmoid(f_pre_t),
    h_t = C_t^T q^_t / (max(|n_t^T q^_t|, 1) + eps),  q^ = q / sqrt(K).

(The stabilised form's eps differs from this one's by a factor exp(m_t), which does not matter at eps = 1e-6.) So the
kernel is no bug in lm's glue, and "auto" keeps mLSTM on the torch code, whose gradient is the layer's.

    python -m lm.bench.mlstm_kernels_grad [--T 16] [--heads 2] [--K 16] [--V 32]

It runs the kernel on CUDA, or on the CPU under Triton's interpreter: TRITON_INTERPRET=1 with a Triton older than
3.7 (mlstm_kernels uses block pointers, which later Triton removed) and NumPy older than 2 (Triton 3.6's interpreter
fails on NumPy 2). docs/performance.md has the figures and the command that gave them.
"""

import argparse
import json

import torch

from lm.ops.mlstm import mlstm

NAMES = ("q", "k", "v", "i_pre", "f_pre")


def unstabilised_mlstm(q, k, v, i_pre, f_pre, eps: float, constant_normaliser: bool) -> torch.Tensor:
    """The layer token by token ([B, H, T, *] inputs), with or without the normaliser detached from autograd."""
    B, H, T, K = q.shape
    C, n, outs = q.new_zeros(B, H, K, v.shape[-1]), q.new_zeros(B, H, K), []
    for t in range(T):
        f, weight = torch.sigmoid(f_pre[:, :, t])[..., None], i_pre[:, :, t].exp()[..., None]
        C = f[..., None] * C + (weight * k[:, :, t])[..., None] * v[:, :, t, None, :]
        n = f * n + weight * k[:, :, t]
        q_hat = q[:, :, t] / K**0.5
        normaliser = torch.clamp((n * q_hat).sum(-1).abs(), min=1.0) + eps
        if constant_normaliser:
            normaliser = normaliser.detach()
        outs.append((C * q_hat[..., None]).sum(-2) / normaliser[..., None])
    return torch.stack(outs, dim=2)


def gradients(fn, inputs: list[torch.Tensor], proj: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    return out.detach(), list(torch.autograd.grad((out * proj).sum(), leaves))


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def compare(T: int = 16, heads: int = 2, K: int = 16, V: int = 32, eps: float = 1e-6, seed: int = 0) -> dict:
    """Output and input-gradient errors of the kernel against lm's op, and against the float64 layer with and without
    a constant normaliser (float32 inputs, layout [B, H, T, *], one chunk of T)."""
    from mlstm_kernels.torch import get_mlstm_kernel

    kernel = get_mlstm_kernel("chunkwise--triton_xl_chunk")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(1, heads, T, d, generator=g) for d in (K, K, V)]
    inputs += [torch.randn(1, heads, T, generator=g), torch.randn(1, heads, T, generator=g) + 3]
    proj = torch.randn(1, heads, T, V, generator=g)
    inputs, proj = [x.to(device) for x in inputs], proj.to(device)
    heads_last = lambda x: x.transpose(1, 2)  # [B, H, T, *] <-> lm's [B, T, H, *]

    def run_kernel(q, k, v, i_pre, f_pre):
        return kernel(q=q, k=k, v=v, i=i_pre, f=f_pre, eps=eps, chunk_size=T, autocast_kernel_dtype=torch.float32)

    def run_lm(*args):
        out, _ = mlstm(*(heads_last(x) for x in args), eps=eps, chunk_size=T, backend="torch")
        return heads_last(out)

    got, got_grads = gradients(run_kernel, inputs, proj)
    results = {"T": T, "heads": heads, "K": K, "V": V, "eps": eps, "device": device.type, "rows": []}
    references = {"lm's op (float32)": (run_lm, inputs, proj)}
    for constant in (False, True):
        name = "float64 layer, constant normaliser" if constant else "float64 layer"
        fn = lambda *a, constant=constant: unstabilised_mlstm(*a, eps=eps, constant_normaliser=constant)
        references[name] = (fn, [x.double() for x in inputs], proj.double())
    for name, (fn, args, weights) in references.items():
        want, want_grads = gradients(fn, args, weights)
        row = {"reference": name, "out": relative_error(got, want)}
        row.update({f"d{n}": relative_error(a, b) for n, a, b in zip(NAMES, got_grads, want_grads)})
        results["rows"].append(row)
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    for name, default in (("T", 16), ("heads", 2), ("K", 16), ("V", 32)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args(argv)
    result = compare(args.T, args.heads, args.K, args.V)
    print(json.dumps(result, indent=2))
    print(f"\nmlstm_kernels' chunkwise--triton_xl_chunk against references ({result['device']}, float32, T {args.T}, "
          f"{args.heads} heads, K {args.K}, V {args.V}): relative errors\n")
    print("| reference | out | " + " | ".join(f"d{n}" for n in NAMES) + " |")
    print("|---" * (2 + len(NAMES)) + "|")
    for row in result["rows"]:
        print(f"| {row['reference']} | {row['out']:.1e} | " + " | ".join(f"{row['d' + n]:.1e}" for n in NAMES) + " |")
    return result


if __name__ == "__main__":
    main()
