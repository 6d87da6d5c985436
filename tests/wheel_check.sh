#!/usr/bin/env bash
# The wheel as a user gets it: build it from this checkout (not editable), install it into a fresh virtual
# environment, and use it from a directory that is not the checkout, offline.
#
#   1. build the wheel; its top level holds lm/, lm-*.dist-info/ and lm_startup.pth alone, and lm/_shipped/ the assets
#   2. a fresh venv: torch as the Makefile installs it (TORCH=torch==X picks another), then the wheel with its needs
#   3. from an empty directory: `import eval` (bench, data_prep, slurm, configs) fails while lm.* imports; `lm demo`
#      on the shipped recipe shrunk to 2 small layers and 4 steps (prepare the bundled corpus, train, eval ppl,
#      generate); `lm compare plan` names the paper's Hawk-Mesa with its layer pattern; `lm compare ladder` plans the
#      shipped configs/ladder/cpu.yaml; lm-eval's own CLI and
#      `lm eval harness` run lm's shipped offline task kjv_cloze on the demo's checkpoint
#
# Prints each step's time, removes its temporary folder (KEEP=1 keeps it), and exits non-zero naming the failed step.
# Run by `make wheel-check` and by .ci/run. Needs the package registries for the build backend and lm's dependencies
# (pip's cache makes a rerun quicker); nothing is downloaded once the wheel is installed.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
TORCH=${TORCH:-torch==2.13.0}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/lm-wheel-check.XXXXXX")
VENV=$WORK/venv
DIST=$WORK/dist
USER_DIR=$WORK/user  # the user's working directory: not the checkout, nothing of it on sys.path
STEP="setup"
TIMES=()  # "step: seconds", printed at the end
START=$(date +%s%N)
STEP_T0=$START

# seconds since $1 (date +%s%N), to a tenth
since() {
    local ms=$((($(date +%s%N) - $1) / 1000000))
    printf '%d.%d' $((ms / 1000)) $((ms % 1000 / 100))
}

finish() {
    local rc=$?
    if [[ ${KEEP:-0} == 1 ]]; then
        echo "wheel-check: kept $WORK"
    else
        rm -rf "$WORK"
    fi
    if [[ ${#TIMES[@]} -gt 0 ]]; then
        printf 'wheel-check: %s\n' "${TIMES[@]}"
    fi
    if [[ $rc -ne 0 ]]; then
        echo "wheel-check: FAILED in step '$STEP' after $(since "$STEP_T0") s (exit $rc)" >&2
    else
        echo "wheel-check: passed in $(since "$START") s"
    fi
    exit "$rc"
}
trap finish EXIT

fail() {
    echo "wheel-check: $*" >&2
    return 1
}

# step NAME FUNCTION: run it, then print its wall time
step() {
    STEP=$1
    echo "wheel-check: -- $1"
    STEP_T0=$(date +%s%N)
    "$2"
    TIMES+=("$(printf '%-28s %6s s' "$1" "$(since "$STEP_T0")")")
    echo "wheel-check: ${TIMES[-1]}"
}

# Commands as a user of the installed wheel runs them: the venv first on PATH, from USER_DIR, offline, and nothing
# of the checkout or of another environment in the way.
as_user() {
    (cd "$USER_DIR" && env -u PYTHONPATH -u PYTHONHOME -u VIRTUAL_ENV PATH="$VENV/bin:$PATH" WANDB_MODE=offline \
        HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$@")
}

make_venv() {
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -qq --upgrade pip
    mkdir -p "$DIST" "$USER_DIR"
}

build_wheel() {
    # An isolated build: pip takes hatchling from the registry, as any user's pip does.
    "$VENV/bin/pip" wheel -qq --no-deps -w "$DIST" "$ROOT"
    local wheels=("$DIST"/lm-*.whl)
    [[ ${#wheels[@]} -eq 1 && -f ${wheels[0]} ]] || fail "expected one lm wheel in $DIST, found: $(ls "$DIST")"
    WHEEL=${wheels[0]}
    echo "wheel-check: built $(basename "$WHEEL") ($(du -h "$WHEEL" | cut -f1))"
}

check_contents() {
    "$VENV/bin/python" - "$WHEEL" <<'EOF'
import sys
import zipfile

names = zipfile.ZipFile(sys.argv[1]).namelist()
top = {n.split("/")[0] + ("/" if "/" in n else "") for n in names}
allowed = lambda t: t == "lm/" or t == "lm_startup.pth" or (t.startswith("lm-") and t.endswith(".dist-info/"))
extra = sorted(t for t in top if not allowed(t))
problems = [f"unexpected top-level entries: {', '.join(extra)}"] if extra else []
problems += [f"missing top-level {t}" for t in ("lm/", "lm_startup.pth") if t not in top]
needed = ["lm/__init__.py", "lm/cli/__init__.py", "lm/eval/harness.py", "lm/bench/__init__.py", "lm/data_prep/prepare.py",
          "lm/slurm/submit.py", "lm/_shipped/configs/demo.yaml", "lm/_shipped/configs/hawk_mesa/145m.yaml",
          "lm/_shipped/eval/suites/standard.yaml", "lm/_shipped/eval/tasks/kjv_cloze/kjv_cloze.yaml",
          "lm/_shipped/eval/tasks/kjv_cloze/kjv_cloze.jsonl", "lm/_shipped/eval/tasks/based_recall/utils.py",
          "lm/_shipped/slurm/site.example.yaml", "lm/_shipped/data_prep/corpus/kjv.jsonl.gz",
          "lm/_shipped/configs/data/slimpajama.yaml"]
problems += [f"missing {n}" for n in needed if n not in names]
if not any(n.startswith("lm/_shipped/slurm/templates/") and ".sbatch" in n for n in names):
    problems.append("missing the sbatch template under lm/_shipped/slurm/templates/")
cached = sorted({n.rsplit("/", 1)[0] for n in names if "__pycache__/" in n or n.endswith(".pyc")})
problems += [f"compiled files shipped: {', '.join(cached)}"] if cached else []
if problems:
    sys.exit("wheel-check: the wheel is wrong:\n  " + "\n  ".join(problems))
print(f"wheel-check: {len(names)} files; top level: {', '.join(sorted(top))}")
EOF
}

install_torch() {
    # As the Makefile: the pinned build first (a CPU build where the machine's pip finds one on disk), else any >= 2.5.
    "$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/pip" install -qq "$TORCH" \
        || "$VENV/bin/pip" install -qq "torch>=2.5"
}

install_wheel() {
    "$VENV/bin/pip" install -qq "$WHEEL"
    local where
    where=$(as_user python -c "import lm; print(lm.__file__)")
    [[ $where == "$VENV"/* ]] || fail "lm is imported from $where, not from the fresh venv"
}

check_imports() {
    local name out
    for name in eval bench data_prep slurm configs; do
        if out=$(as_user python -c "import $name" 2>&1); then
            fail "\`import $name\` works from the wheel; only lm may be importable"
        fi
        [[ $out == *"ModuleNotFoundError: No module named '$name'"* ]] \
            || fail "\`import $name\` failed, but not as a missing module: $out"
    done
    as_user python -c "import lm.eval.harness, lm.eval.run_harness, lm.bench, lm.data_prep.prepare, lm.slurm.submit, \
lm.compare.paper_sizes, lm.util.resources; from lm.util.resources import shipped; assert shipped('configs/demo.yaml').is_file()"
}

run_demo() {
    # The shipped demo recipe shrunk to seconds (at its own size, 4 steps take about 60 s on 2 cores: most of it the
    # validation windows and start-up, not the steps).
    local out
    as_user python - <<'EOF'
import yaml

from lm.util.resources import shipped

recipe = yaml.safe_load(shipped("configs/demo.yaml").read_text())
recipe["model"].update(vocab_size=512, d_model=64, n_layers=2, n_heads=2, head_dim=32, max_seq_len=64)
recipe["data"].update(seq_len=64, micro_batch=4, val_windows=8)
recipe["trainer"].update(max_steps=4, val_every=4, ckpt_every=4, log_every=1)
open("tiny.yaml", "w").write(yaml.safe_dump(recipe))
EOF
    out=$(as_user lm demo --recipe tiny.yaml --run_dir runs/demo --progress false --sample_tokens 20 2>&1) \
        || { echo "$out" | tail -40; fail "lm demo failed"; }
    echo "$out" | tail -14
    CHECKPOINT=$(echo "$out" | awk '$1 == "checkpoint" {print $2}' | tail -1)
    [[ -n $CHECKPOINT ]] || fail "lm demo printed no checkpoint"
    [[ $CHECKPOINT == /* ]] || CHECKPOINT=$USER_DIR/$CHECKPOINT
    [[ -e $CHECKPOINT ]] || fail "lm demo's checkpoint $CHECKPOINT does not exist"
    grep -q "validation ppl" <<<"$out" || fail "lm demo printed no validation ppl"
    grep -q "^sample:" <<<"$out" || fail "lm demo printed no sample"
}

run_plan() {
    local out
    out=$(as_user lm compare plan --archs '[hawk_mesa]' --params 5e6 --vocab_size 4096 --out plan 2>&1) \
        || { echo "$out" | tail -20; fail "lm compare plan --archs '[hawk_mesa]' failed (is the hybrid known?)"; }
    echo "$out" | grep "| hawk_mesa |" || { echo "$out"; fail "lm compare plan does not list hawk_mesa"; }
    grep -q "layer_pattern: hawk,mesa" "$USER_DIR"/plan/configs/hawk_mesa-*.yaml \
        || fail "lm compare plan's hawk_mesa configs lack layer_pattern: hawk,mesa"
}

run_ladder_plan() {
    local out
    out=$(as_user lm compare ladder configs/ladder/cpu.yaml --dry_run true 2>&1) \
        || { echo "$out" | tail -20; fail "lm compare ladder configs/ladder/cpu.yaml (the shipped ladder) failed"; }
    # Every arch of configs/ladder/cpu.yaml at its largest rung (Mesa's chosen CG steps planned at the choice's
    # reference, the costliest), read from the file, so that the check follows it.
    local arch archs
    archs=$("$VENV/bin/python" -c 'import sys, yaml; c = yaml.safe_load(open(sys.argv[1])); print("\n".join(
        a.replace("=chosen", "=" + str(c["choose"]["reference"])) for a in c["archs"]))' "$ROOT/configs/ladder/cpu.yaml") \
        || fail "configs/ladder/cpu.yaml does not read as YAML"
    for arch in $archs; do
        echo "$out" | grep -qF "| $arch | 310k |" || { echo "$out"; fail "the shipped CPU ladder lacks $arch's 310k rung"; }
    done
}

run_lm_eval_cli() {
    local tasks results
    tasks=$(as_user lm eval tasks --path true)
    [[ $tasks == "$VENV"/* ]] || fail "lm eval tasks --path true gives $tasks, not a folder inside the fresh venv"
    as_user lm_eval --model lm --model_args "checkpoint=$CHECKPOINT" --tasks kjv_cloze --include_path "$tasks" \
        --limit 16 --batch_size 4 --device cpu --output_path lm-eval-out
    results=$(find "$USER_DIR/lm-eval-out" -name 'results*.json' | head -1)
    [[ -n $results ]] || fail "lm_eval wrote no results*.json"
    as_user python - "$results" <<'EOF'
import json
import sys

acc = json.load(open(sys.argv[1]))["results"]["kjv_cloze"]["acc,none"]
assert 0 <= acc <= 1, acc
print(f"wheel-check: lm_eval kjv_cloze acc {acc:.3f} (16 items)")
EOF
}

run_lm_eval_harness() {
    # lm's own command, which always includes the shipped eval/tasks
    as_user lm eval harness --checkpoint "$CHECKPOINT" --tasks '[kjv_cloze]' --limit 8 --out harness-out
    [[ -s $USER_DIR/harness-out/results.md ]] || fail "lm eval harness wrote no results.md"
}

step "venv" make_venv
step "build wheel" build_wheel
step "wheel contents" check_contents
step "install torch" install_torch
step "install wheel" install_wheel
step "only lm importable" check_imports
step "lm demo (tiny, 4 steps)" run_demo
step "lm compare plan hawk_mesa" run_plan
step "lm compare ladder (shipped CPU ladder, planned)" run_ladder_plan
step "lm_eval CLI kjv_cloze" run_lm_eval_cli
step "lm eval harness kjv_cloze" run_lm_eval_harness
