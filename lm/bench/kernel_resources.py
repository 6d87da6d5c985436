"""What Mesa's Triton kernels need from a Hopper SM, found without a GPU: each kernel is compiled for sm_90 by the
installed Triton (its front end, LLVM and the ptxas it bundles; no driver is used). The cuobjdump it bundles reads
registers per thread and the stack (local memory per thread, which holds the spilled registers) from the binary;
Triton's metadata gives the shared memory a program asks for. A program asking for more shared memory than an SM has
(227 KiB on H100 and H200) cannot launch, and spills cost time on every CG step.

    python -m lm.bench.kernel_resources [--shapes K,V,CHUNK,...] [--json_out PATH]

The default shapes are the 1B config's heads (K = V = 128) and the 400M ones (K = V = 64), at the chunk the kernels
choose (`lm.ops.mesa_triton.kernel_chunk`) and at twice that.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from functools import partial

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from lm.ops import mesa_triton
from lm.util.output import write_json

HOPPER = GPUTarget("cuda", 90, 32)
SM_SHARED_BYTES = 227 * 1024
SOLVE_POINTERS = ("rhs_ptr", "k_ptr", "v_ptr", "lg_ptr", "beta_ptr", "reset_ptr", "lam_ptr", "g_ptr", "h_ptr", "x_ptr",
                  "out_ptr", "iterations_ptr", "residual_ptr", "diag_ptr")
STATES_POINTERS = ("k_ptr", "r_ptr", "lg_ptr", "beta_ptr", "reset_ptr", "s0_ptr", "entering_ptr", "final_ptr")
HALF_INPUTS = ("rhs_ptr", "k_ptr", "v_ptr", "r_ptr", "out_ptr")  # bf16 in training


def signature(pointers, integers, constexprs, fp_args=()) -> dict:
    sig = {name: "*bf16" if name in HALF_INPUTS else "*i8" if name == "reset_ptr" else "*fp32" for name in pointers}
    sig.update({name: "i32" for name in integers})
    sig.update({name: "fp32" for name in fp_args})
    sig.update({name: "constexpr" for name in constexprs})
    return sig


def cuobjdump() -> str:
    """Triton's cuobjdump (TRITON_CUOBJDUMP_PATH, else its own), else the one beside TRITON_PTXAS_PATH: a Triton packed
    by bench/triton_minimal.sh carries none."""
    try:
        return triton.knobs.nvidia.cuobjdump.path
    except RuntimeError:
        return os.path.join(os.path.dirname(os.environ.get("TRITON_PTXAS_PATH", "")), "cuobjdump")


def binary_resources(cubin: bytes) -> dict:
    """Registers and stack bytes per thread of the compiled kernel, from `cuobjdump --dump-resource-usage`."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        usage = subprocess.run([cuobjdump(), "--dump-resource-usage", path], capture_output=True, text=True,
                               check=True).stdout
    return {"registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "stack": int(re.search(r"STACK:(\d+)", usage).group(1))}


def compile_kernel(fn, sig: dict, constexprs: dict, num_warps: int) -> dict:
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=HOPPER,
                              options={"num_warps": num_warps})
    report = binary_resources(compiled.asm["cubin"])
    report["shared"] = compiled.metadata.shared
    report["fits"] = compiled.metadata.shared <= SM_SHARED_BYTES
    return report


def solve_resources(K: int, V: int, chunk: int, adjoint: bool, has_tol: bool = True) -> dict:
    """The solve kernel as `chunk_solve` launches it for bf16 inputs with resets."""
    constexprs = dict(C=chunk, BK=mesa_triton.block(K), BV=mesa_triton.block(V), ADJOINT=adjoint, HAS_RESET=True,
                      HAS_TOL=has_tol, DTYPE=tl.float32, PRECISION="tf32x3")
    sig = signature(SOLVE_POINTERS, ("T", "H", "K", "V", "N", "steps"), constexprs, fp_args=("tol_sq",))
    return compile_kernel(mesa_triton._solve_kernel, sig, constexprs, mesa_triton.solve_warps(K, V))


def states_resources(K: int, R: int, chunk: int) -> dict:
    """The chunk-entry state kernel as `chunk_entry_states` launches it (rows R: V for G, K for H)."""
    constexprs = dict(C=chunk, BR=min(mesa_triton.block(R), 64), BK=mesa_triton.block(K), HAS_RESET=True,
                      DTYPE=tl.float32, PRECISION="tf32x3")
    sig = signature(STATES_POINTERS, ("T", "H", "R", "K", "N"), constexprs)
    return compile_kernel(mesa_triton._entry_states_kernel, sig, constexprs, 4)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--shapes", nargs="*", default=None, help="K,V,CHUNK triples (default: see the module doc)")
    parser.add_argument("--json_out", default=None)
    args = parser.parse_args(argv)
    if args.shapes:
        shapes = [tuple(int(n) for n in shape.split(",")) for shape in args.shapes]
    else:
        shapes = [(K, K, c) for K in (128, 64) for c in (mesa_triton.kernel_chunk(64, K, K),
                                                          2 * mesa_triton.kernel_chunk(64, K, K))]
    rows = []
    for K, V, chunk in shapes:
        for kernel, report in (("forward solve", partial(solve_resources, K, V, chunk, adjoint=False)),
                               ("adjoint solve", partial(solve_resources, K, V, chunk, adjoint=True)),
                               ("entry states", partial(states_resources, K, max(K, V), chunk))):
            rows.append({"kernel": kernel, "K": K, "V": V, "chunk": chunk, **report()})
            print(rows[-1], file=sys.stderr, flush=True)
    print(f"Mesa's Triton kernels compiled for sm_90 by Triton {triton.__version__} (bf16 inputs, fp32 solve, "
          "3xTF32 products, resets and a tolerance)\n")
    print("| kernel | K | V | chunk | shared KiB | fits an SM | registers | stack bytes (spills) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['K']} | {r['V']} | {r['chunk']} | {r['shared'] / 1024:.0f} | "
              f"{'yes' if r['fits'] else 'no'} | {r['registers']} | {r['stack']} |")
    if args.json_out:
        write_json(args.json_out, {"triton": triton.__version__, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
