#!/usr/bin/env bash
# The GPU check, in one run on a lent machine (one H100/H200; about 9 minutes):
#   1. the GPU-only tests: fla / mlstm_kernels kernels against the torch path (and DeepSpeed bf16 if installed);
#   2. bf16 training throughput, MFU and peak memory of the 400M and 1B configs of every mixer at sequence
#      2048 and 8192 (`lm bench train`, fla kernels where they apply), MFU against 989 TFLOP/s dense bf16.
#
#   bench/gpu.sh [OUT_DIR]        results: OUT_DIR/{env.txt,gpu-tests.txt,gpu-train.json,gpu-train.md}
#
# The machine needs torch with CUDA. Packages it lacks travel as wheels: `make gpu-wheels` downloads them into
# .whl/ here, and this script installs them from there (no network needed there). SMOKE=1 runs the same steps
# at tiny sizes on the CPU (tests/test_gpu_script.py does), so the script itself is tested where there is no GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-bench-gpu}}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-deps --no-index .whl/*.whl > "$OUT/pip.txt" 2>&1 || echo "wheel install failed: see pip.txt"
fi

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
    "$PY" - <<'EOF'
import importlib.metadata as md
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device",
      torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
for name in ("triton", "flash-linear-attention", "mlstm_kernels", "deepspeed", "jsonargparse"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
EOF
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [ "${SMOKE:-0}" = 1 ]; then
    TESTS=(tests/test_ops_gpu.py)  # skipped without CUDA: checks only that pytest runs them
    CONFIGS="[$OUT/smoke-attention.yaml, $OUT/smoke-gated_deltanet.yaml]"
    for mixer in attention gated_deltanet; do
        sed -e "s/^\(  d_model:\).*/\1 32/" -e "s/^\(  n_layers:\).*/\1 1/" -e "s/^\(  n_heads:\).*/\1 2/" \
            -e "s/^\(  head_dim:\).*/\1 16/" -e "s/^\(  vocab_size:\).*/\1 256/" -e "s/^\(  mlp_ratio:\).*/\1 2.0/" \
            "configs/$mixer/400m.yaml" > "$OUT/smoke-$mixer.yaml"
    done
    LENGTHS="[16, 40]" TOKENS=80 STEPS=1 WARMUP=0 BUDGET=60
else
    TESTS=(tests/test_ops_gpu.py tests/test_ops_gpu_mesa.py tests/test_ops_gpu_mlstm.py)
    "$PY" -c "import deepspeed" 2>/dev/null && TESTS+=(tests/test_scale_out_gpu.py)
    # Every paper-size config (each mixer and hybrid), the 400M ones first, so a budget cut drops 1B ones first.
    CONFIGS="["
    for size in 400m 1b; do
        for config in configs/*/$size.yaml; do
            CONFIGS+="$config, "
        done
    done
    CONFIGS="${CONFIGS%, }]"
    LENGTHS="[2048, 8192]" TOKENS=16384 STEPS=5 WARMUP=2 BUDGET=360
fi

echo "== GPU tests: ${TESTS[*]}"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" > "$OUT/gpu-tests.txt" 2>&1
echo "pytest exit status $?" >> "$OUT/gpu-tests.txt"
tail -n 5 "$OUT/gpu-tests.txt"

echo "== training throughput"
"$PY" -m lm.cli bench train --configs "$CONFIGS" --seq_len "$LENGTHS" --batch_tokens "$TOKENS" \
    --steps "$STEPS" --warmup "$WARMUP" --peak_flops 989e12 --budget_s "$BUDGET" \
    --json_out "$OUT/gpu-train.json" > "$OUT/gpu-train.log" 2>&1
status=$?
sed -n '/^$/,$p' "$OUT/gpu-train.log" > "$OUT/gpu-train.md"  # the table after the JSON
cat "$OUT/gpu-train.md"
[ $status = 0 ] || tail -n 20 "$OUT/gpu-train.log"
exit $status
