#!/usr/bin/env bash
# The GPU check on a lent machine (one H100/H200), in two calls of at most about 9.5 minutes each, within the device
# tool's 10-minute limit (TEST_TIMEOUT, MESA_TIMEOUT, BUDGET_2K, BUDGET_8K, COMPILE_TIMEOUT and BUDGET_400M set its
# parts' limits). CALL=1 (the default):
#   1. the packages the machine lacks, installed into LM_SITE (/tmp/lm-site) from the wheels that `make gpu-wheels`
#      put in .whl/ (with the Triton that `make gpu-triton` packs there, if any), and every kernel package imported:
#      a failure stops the script at once;
#   2. the GPU-only tests (Mesa's Triton kernels against the float64 solve and fla's chunk_mesa_net; fla,
#      mlstm_kernels and liger-kernel against the torch code, every mixer's model on CUDA against the CPU, DeepSpeed
#      bf16): they must all pass with 0 skipped, and their wall time, which on a fresh machine is mostly Triton
#      compiling and autotuning the kernels, is stated;
#   3. Mesa's op against fla's chunk_mesa_net (`lm bench peers --peers [fla]`, the 1B config's heads, T 2048 and
#      8192, 30 CG steps): forward + backward time and the error against the float64 solve;
#   4. bf16 training throughput, MFU, peak memory and first-step time (compiling and autotuning included, apart from
#      the step time) of every mixer's 1B config at T 2048 (`lm bench train`), Mesa first (30 CG steps, then cg_tol
#      1e-4), each row saved as it ends and the rows not started within the budget marked skipped.
# CALL=2 (the same machine, still warm, or a fresh one): step 1, then every 1B config at T 8192, every 400M config at
# 2048, and `lm bench compile` (eager vs trainer.compile's inductor per mixer, bf16 autocast, rows saved as they end).
# CALL=1 on a machine with two or more GPUs also runs `lm bench context` (context parallelism over 2 and 4 GPUs, NCCL).
#
#   bench/gpu.sh [OUT_DIR]     results: OUT_DIR/{env.txt,gpu-tests.txt,mesa-peer.json,mesa-peer.md,gpu-train.json,
#                              gpu-train.md,summary.txt}, and with CALL=2 compile.json and compile.md
#
# Exit status 0 only when every step passed. SMOKE=1 runs the same steps at tiny sizes on the CPU, where the GPU
# tests skip (tests/test_gpu_script.py does), so that the script itself is tested where there is no GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-bench-gpu}}
PY=${PYTHON:-python3}
SMOKE=${SMOKE:-0}
CALL=${CALL:-1}
mkdir -p "$OUT"
START=$SECONDS
failed=()
say() { echo "$*" | tee -a "$OUT/summary.txt"; }
: > "$OUT/summary.txt"

# 1. packages
WHEELS=${WHEELS:-.whl}
SITE=${LM_SITE:-/tmp/lm-site}
if [ "$SMOKE" != 1 ]; then
    if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        say "FAIL no wheels in $WHEELS/: run \`make gpu-wheels\` here and carry .whl"; exit 1
    fi
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "$WHEELS"/*.whl > "$OUT/pip.txt" 2>&1; then
        tail -n 20 "$OUT/pip.txt"; say "FAIL wheel install (see pip.txt)"; exit 1
    fi
    # A newer Triton (`make gpu-triton`: fla refuses its gated backward on Hopper under the image's 3.6.0), unpacked
    # after the wheels so that it wins on PYTHONPATH. It comes without ptxas and the other CUDA tools: the image's
    # Triton lends its own, found before $SITE goes on the path.
    triton_tar=$(ls "$WHEELS"/triton-*-minimal.tar.xz 2>/dev/null | tail -n 1)
    if [ -n "$triton_tar" ]; then
        image_triton=$(env -u PYTHONPATH "$PY" -c 'import os, triton; print(os.path.dirname(triton.__file__))')
        for tool in ptxas ptxas-blackwell cuobjdump nvdisasm; do  # else CUDA's own, where on PATH
            path="$image_triton/backends/nvidia/bin/$tool"; [ -x "$path" ] || path=$(command -v "$tool") || continue
            var=${tool^^}; export "TRITON_${var//-/_}_PATH=$path"
        done
        if [ -z "${TRITON_PTXAS_PATH:-}" ]; then
            say "FAIL no ptxas for $triton_tar: the image has neither Triton's nor CUDA's"; exit 1
        fi
        rm -rf "$SITE"/triton "$SITE"/triton-*.dist-info
        if ! "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
                "$triton_tar" "$SITE" >> "$OUT/pip.txt" 2>&1; then
            tail -n 20 "$OUT/pip.txt"; say "FAIL unpacking $triton_tar (see pip.txt)"; exit 1
        fi
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
    "$PY" - <<'EOF'
import importlib.metadata as md
import os
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device",
      torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
for name in ("triton", "flash-linear-attention", "fla-core", "mlstm_kernels", "liger-kernel", "deepspeed",
             "lightning", "transformers", "jsonargparse"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
try:  # the Triton that imports (`make gpu-triton`'s where carried) and the ptxas it is given
    import triton
    print("triton imported", triton.__version__, "from", os.path.dirname(triton.__file__), "ptxas",
          os.environ.get("TRITON_PTXAS_PATH", "its own"))
except ImportError as error:
    print("triton not importable:", error)
EOF
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if [ "$SMOKE" != 1 ]; then
    if ! "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'
import fla.ops.gated_delta_rule, fla.ops.simple_gla, fla.ops.gla, fla.ops.hgrn, fla.ops.mesa_net
import mlstm_kernels.torch, liger_kernel.transformers.functional, deepspeed, jsonargparse" > "$OUT/imports.txt" 2>&1
    then
        tail -n 20 "$OUT/imports.txt"; say "FAIL a kernel package or CUDA is missing (see imports.txt)"; exit 1
    fi
fi
say "packages ok after $((SECONDS - START)) s"

if [ "$CALL" = 1 ]; then
# 2. GPU tests
TESTS=(tests/test_ops_gpu.py tests/test_ops_gpu_delta.py tests/test_ops_gpu_mesa.py tests/test_ops_gpu_mlstm.py
       tests/test_model_gpu.py tests/test_scale_out_gpu.py tests/test_flex_attention.py)
t0=$SECONDS
# -v: each test's result as it ends, so that the outer time limit leaves a record; on the GPU machine pytest-timeout
# (in its image) also fails a single test stuck past 150 s rather than letting it take the whole limit.
PER_TEST=(); [ "$SMOKE" = 1 ] || PER_TEST=(--timeout 150)
timeout "${TEST_TIMEOUT:-220}" "$PY" -m pytest -v --tb=short -rs -p no:cacheprovider --durations=15 "${PER_TEST[@]}" \
    "${TESTS[@]}" > "$OUT/gpu-tests.txt" 2>&1
status=$?
summary=$(tail -n 1 "$OUT/gpu-tests.txt")
echo "pytest exit status $status" >> "$OUT/gpu-tests.txt"
say "GPU tests: $summary (exit $status) in $((SECONDS - t0)) s wall, on a fresh machine mostly Triton compiling"
if [ "$SMOKE" = 1 ]; then
    [ $status = 0 ] || [ $status = 5 ] || failed+=("GPU tests (smoke)")  # 5: every test skipped, as on a CPU
else
    [ $status = 0 ] || failed+=("GPU tests")
    echo "$summary" | grep -q "skipped" && failed+=("GPU tests skipped some")
fi

# 3. Mesa's op against fla's
if [ "$SMOKE" = 1 ]; then
    MESA=(--mesa_lengths "[40]" --mesa_heads 2 --mesa_head_dim 8 --repeats 1)
else
    MESA=(--mesa_lengths "[2048, 8192]" --mesa_heads 12 --mesa_head_dim 128 --mesa_batch 1 --repeats 3)
fi
t0=$SECONDS
timeout "${MESA_TIMEOUT:-90}" "$PY" -m lm.cli bench peers --peers "[fla]" --cg_steps 30 "${MESA[@]}" \
    --json_out "$OUT/mesa-peer.json" > "$OUT/mesa-peer.md" 2>&1
status=$?
say "Mesa op against fla's chunk_mesa_net: exit $status in $((SECONDS - t0)) s"
[ $status = 0 ] || { tail -n 20 "$OUT/mesa-peer.md"; failed+=("lm bench peers (mesa)"); }
fi

# 4. training throughput
if [ "$SMOKE" = 1 ]; then
    for mixer in attention gated_deltanet; do
        sed -e "s/^\(  d_model:\).*/\1 32/" -e "s/^\(  n_layers:\).*/\1 1/" -e "s/^\(  n_heads:\).*/\1 2/" \
            -e "s/^\(  head_dim:\).*/\1 16/" -e "s/^\(  vocab_size:\).*/\1 256/" -e "s/^\(  mlp_ratio:\).*/\1 2.0/" \
            "configs/$mixer/400m.yaml" > "$OUT/smoke-$mixer.yaml"
    done
    sed -e "s/^\(  mixer:\).*/\1 mesa/" "$OUT/smoke-attention.yaml" > "$OUT/smoke-mesa.yaml"
    MESA_CONFIG="$OUT/smoke-mesa.yaml"
    tiny="[$OUT/smoke-attention.yaml, $OUT/smoke-gated_deltanet.yaml]"
    RUNS=("$tiny|[16, 40]|60" "[$OUT/mesa-1b-cg_tol.yaml]|[16]|60")
    [ "$CALL" = 1 ] || RUNS=("$tiny|[24]|60")
    COMPILE=(--mixers "[attention]" --d_model 32 --n_layers 1 --head_dim 16 --seq_len 16 --vocab_size 256
             --repeats 1 --backend aot_eager_decomp_partition)
    TOKENS=80 STEPS=1 WARMUP=1
else
    MESA_CONFIG=configs/mesa/1b.yaml
    # Mesa's rows first (with cg_tol 1e-4 next), then the comparison's references: a budget that runs out skips
    # what comes last.
    others=$(ls configs/*/1b.yaml | grep -v -e '^configs/mesa/' -e gated_deltanet -e '^configs/attention/')
    big="[configs/mesa/1b.yaml, $OUT/mesa-1b-cg_tol.yaml, configs/gated_deltanet/1b.yaml, configs/attention/1b.yaml"
    big="$big, $(echo $others | sed 's/ /, /g')]"
    every=$(printf '%s, ' configs/*/400m.yaml)
    if [ "$CALL" = 1 ]; then
        RUNS=("$big|[2048]|${BUDGET_2K:-180}")
    else
        RUNS=("$big|[8192]|${BUDGET_8K:-270}" "[${every%, }]|[2048]|${BUDGET_400M:-60}")
    fi
    COMPILE=(--d_model 1024 --n_layers 2 --head_dim 128 --seq_len 2048 --batch 4 --vocab_size 50304 --repeats 3)
    TOKENS=16384 STEPS=4 WARMUP=2
fi
# Mesa with a tolerance: each chunk's CG stops once all its tokens reach a relative residual of 1e-4.
sed -e "/^  mixer: mesa/a\  mixer_options: {mesa: {cg_tol: 1.0e-4}}" "$MESA_CONFIG" > "$OUT/mesa-1b-cg_tol.yaml"
part=0
for run in "${RUNS[@]}"; do
    IFS='|' read -r configs lengths budget <<< "$run"
    part=$((part + 1))
    t0=$SECONDS
    # The budget stops new rows; the hard limit also stops one stuck in a row.
    timeout $((budget + 60)) "$PY" -m lm.cli bench train --configs "$configs" --seq_len "$lengths" \
        --batch_tokens "$TOKENS" --steps "$STEPS" --warmup "$WARMUP" --peak_flops 989e12 --budget_s "$budget" \
        --json_out "$OUT/gpu-train-$part.json" > "$OUT/gpu-train-$part.log" 2>&1
    status=$?
    say "training throughput, part $part: exit $status in $((SECONDS - t0)) s"
    [ $status = 0 ] || { tail -n 20 "$OUT/gpu-train-$part.log"; failed+=("lm bench train part $part"); }
done
# The rows of every part, those finished before a time limit too, as one JSON and one table.
"$PY" - "$OUT" > "$OUT/gpu-train.md" <<'EOF'
import glob, json, sys
from lm.bench.train_speed import print_table
parts = [json.load(open(p)) for p in sorted(glob.glob(f"{sys.argv[1]}/gpu-train-*.json"))]
if parts:
    merged = dict(parts[0], rows=[r for p in parts for r in p["rows"]])
    json.dump(merged, open(f"{sys.argv[1]}/gpu-train.json", "w"), indent=2)
    print_table(merged)
EOF
cat "$OUT/gpu-train.md"

# 5. (CALL=2) trainer.compile per mixer: eager vs inductor-compiled training steps, compile time, graph breaks
if [ "$CALL" = 2 ]; then
    t0=$SECONDS
    timeout "${COMPILE_TIMEOUT:-150}" "$PY" -m lm.cli bench compile "${COMPILE[@]}" --json_out "$OUT/compile.json" \
        > "$OUT/compile.md" 2>&1
    status=$?
    say "trainer.compile per mixer: exit $status in $((SECONDS - t0)) s"
    [ $status = 0 ] || { tail -n 20 "$OUT/compile.md"; failed+=("lm bench compile"); }
fi

# 6. (CALL=1, two or more GPUs) context parallelism on NCCL: activation memory per GPU and tokens/s of each mixer at T 16384
#    with the window split over 1, 2 (and 4) GPUs (`lm bench context`); one line saying so on a single GPU.
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "$CALL" != 1 ]; then
    :
elif [ "$SMOKE" = 1 ] || [ "${gpus:-0}" -ge 2 ]; then
    pieces="[1, 2]"; [ "${gpus:-0}" -ge 4 ] && pieces="[1, 2, 4]"
    CONTEXT=(--pieces "$pieces" --T 16384 --d_model 1024 --n_heads 8 --head_dim 128 --n_layers 4)
    [ "$SMOKE" = 1 ] && CONTEXT=(--pieces "[1, 2]" --T 64 --d_model 32 --n_heads 2 --head_dim 16 --n_layers 1
                                 --mixers "[gated_deltanet]")
    t0=$SECONDS
    timeout "${CONTEXT_TIMEOUT:-240}" "$PY" -m lm.cli bench context "${CONTEXT[@]}" --json_out "$OUT/context.json" \
        > "$OUT/context.md" 2>&1
    status=$?
    say "context parallelism ($pieces GPUs per window): exit $status in $((SECONDS - t0)) s"
    [ $status = 0 ] || { tail -n 20 "$OUT/context.md"; failed+=("lm bench context"); }
else
    say "context parallelism: skipped, ${gpus:-0} GPU(s) here (it needs two or more)"
fi

say "total $((SECONDS - START)) s"
if [ ${#failed[@]} -gt 0 ]; then
    say "FAIL: ${failed[*]}"
    exit 1
fi
say "all passed"
