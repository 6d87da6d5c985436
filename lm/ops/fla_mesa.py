"""Optional GPU glue: `mesa(..., backend="fla")` through flash-linear-attention's chunked MesaNet kernel,
`fla.ops.mesa_net.chunk_mesa_net` (Triton), imported lazily.

Conventions, read from fla's source (fla/ops/mesa_net/chunk.py, chunk_cg_solver_fwd.py and naive.py; not run here):
- call: chunk_mesa_net(q, k, v, g, beta, lamb, h_kk_init=None, h_kv_init=None, output_final_state=False,
  max_CG_iteration=30, [use_qk_l2norm_in_kernel=False,] cu_seqlens=None) -> (o, h_kk_final, h_kv_final);
- layout [B, T, H, *] for q, k, v and [B, T, H] for g, beta; lamb is [H, K], as ours;
- g is the per-step log-decay (fla cumsums it per chunk), beta scales both writes: h_kk += beta k k^T,
  h_kv += beta k v^T; no scale on q, and q/k are not normalised unless use_qk_l2norm_in_kernel=True (not passed);
- states: h_kk = H [B, H, K, K] and h_kv = G^T [B, H, K, V], float32; o_t = h_kv^T x_t = G_t x_t;
- limits: q, k, v in one half-precision dtype (fla asserts against float32), V == K, K <= 128, chunk size 64 fixed,
  max_CG_iteration steps always (no tolerance, no iteration count reported).
Its CG is not step-for-step ours: fla 0.6 starts every solve from x = 0 (older versions warm-started from the diagonal
of the state entering the chunk; ours starts at q / diag(H_t + Lambda)), runs its CG matmuls in half precision, and
damps alpha and beta by +1e-5 in their denominators, so at a small step count its output differs from the torch code
by about the CG truncation error; both converge to the same solve. That is why mesa's backend="auto" does not pick
fla.
"""

import functools

import torch

from lm.ops.fla import check_fla_backend, check_fla_dtype, fla_call, fla_imports, parameters


@functools.cache
def fla_mesa_available() -> bool:
    """Whether fla's MesaNet kernel imports (lm.ops.fla.fla_imports); cached."""
    return fla_imports("fla.ops.mesa_net")


def fla_mesa_check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cg_tol, return_info: bool,
                   reset: torch.Tensor | None = None) -> None:
    """Raise, with the reason, when `mesa(..., backend="fla")` cannot run these inputs through fla."""
    check_fla_backend("mesa", (q, k, v), fla_mesa_available, "flash-linear-attention with fla.ops.mesa_net")
    check_fla_dtype("mesa", q.dtype)
    K, V = q.shape[-1], v.shape[-1]
    if V != K or K > 128:
        raise ValueError(f"mesa: fla's kernel needs V == K <= 128, got K={K}, V={V}; use backend='torch'")
    if reset is not None:
        raise NotImplementedError("mesa: resets (packed documents) are not wired to fla's kernel; use backend='torch'")
    if cg_tol is not None or return_info:
        raise NotImplementedError(
            "mesa: fla's kernel runs a fixed number of CG steps and reports nothing; cg_tol and return_info need "
            "backend='torch'"
        )


def fla_mesa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_gamma: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor,
    cg_steps: int,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """`mesa` through fla.ops.mesa_net.chunk_mesa_net. Returns (out in q's dtype, (G [B, H, V, K], H [B, H, K, K])
    in float32); autograd goes through fla's own backward."""
    from fla.ops.mesa_net import chunk_mesa_net

    h_kk_init = h_kv_init = None
    if initial_state is not None:
        G0, H0 = initial_state
        h_kk_init = H0.float().contiguous()
        h_kv_init = G0.float().mT.contiguous()  # fla keeps G^T: [B, H, K, V]
    kwargs = dict(
        q=q,
        k=k.to(q.dtype),  # fla's kernels expect q, k, v in one dtype
        v=v.to(q.dtype),
        g=log_gamma.float(),  # gates and lambda in float32, as fla recommends
        beta=beta.float(),
        lamb=lam.float(),
        h_kk_init=h_kk_init,
        h_kv_init=h_kv_init,
        output_final_state=True,
        max_CG_iteration=int(cg_steps),
    )
    if "use_qk_l2norm_in_kernel" in parameters(chunk_mesa_net):
        kwargs["use_qk_l2norm_in_kernel"] = False  # our q and k are used as given
    out, h_kk, h_kv = fla_call(chunk_mesa_net, **kwargs)
    return out.to(q.dtype), (h_kv.float().mT, h_kk.float())
