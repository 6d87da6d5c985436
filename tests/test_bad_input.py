"""Bad input to every command of `lm`: exit status 2, one line on stderr, and nothing written.

Each case runs `main(argv)` in this process, in a fresh working directory (the current directory, so that relative
defaults such as runs/... land there too) that holds a tiny run with a checkpoint, a copy of the prepared data, a
valid training config and a plain file. The whole directory is hashed before and after: a command must check all
its arguments before it creates, changes or deletes anything.
"""

import hashlib
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from lm.cli import main
from lm.util.commands import COMMANDS

TRAIN_YAML = """\
model: {vocab_size: 512, d_model: 32, n_layers: 1, n_heads: 2, head_dim: 16, max_seq_len: 64}
data: {path: data, seq_len: 32, micro_batch: 2, num_workers: 0, val_windows: 2}
trainer: {max_steps: 1, val_every: 1, ckpt_every: 1, log_every: 1, progress_bar: false}
strategy: {accelerator: cpu, devices: 1}
run_dir: newrun
"""
TRAIN = ["train", "--config", "train.yaml"]
SUBMIT = ["slurm", "submit", "--dry_run"]
TRAIN_ARGS = ["--", "--config", "train.yaml"]
PLAN = ["compare", "plan", "--archs", "attention", "--params", "1e5", "--base", "train.yaml", "--out", "plan"]
BAD_YAML = "model:\n  d_model: 32\n\tn_layers: 2\n"  # a tab starts line 3
IN_BAD_YAML = "bad.yaml, line 3: found character '\\t' that cannot start any token"
THREE_TO_ONE = "gated_deltanet,gated_deltanet,gated_deltanet,attention"

# (argv, a part of the one line expected on stderr); paths are relative to the working directory.
CASES = {
    # lm prepare
    "prepare-missing-input": (["prepare", "--inputs", "[nowhere.txt]", "--out", "prepared"], "nowhere.txt"),
    "prepare-zero-vocab": (["prepare", "--vocab_size", "0", "--out", "prepared"], "vocab"),
    "prepare-val-fraction-above-one": (["prepare", "--val_fraction", "1.5", "--out", "prepared"], "val_fraction"),
    "prepare-out-is-a-file": (["prepare", "--out", "file.txt"], "not a directory"),
    "prepare-unknown-key": (["prepare", "--vocab_sise", "64"], "unknown config key 'vocab_sise'"),
    "prepare-task-out-of-range": (["prepare", "--tasks", "2", "--task", "2", "--out", "prepared"], "out of range"),
    "prepare-merge-without-a-plan": (["prepare", "--tasks", "2", "--merge", "true", "--out", "data"], "no plan"),
    "prepare-missing-recipe": (["prepare", "--recipe", "nowhere.yaml", "--out", "prepared"], "nowhere.yaml"),
    "prepare-recipe-yaml-syntax": (["prepare", "--recipe", "bad.yaml", "--out", "prepared"], IN_BAD_YAML),
    # lm train
    "train-negative-lr": ([*TRAIN, "--optim.lr", "-1"], "optim.lr"),
    "train-beta-above-one": ([*TRAIN, "--optim.betas", "[0.9, 1.5]"], "optim.betas"),
    "train-run-dir-is-a-file": ([*TRAIN, "--run_dir", "file.txt"], "file.txt"),
    "train-unknown-probe": ([*TRAIN, "--eval.every", "2", "--eval.probes", "[nope]"], "eval.probes: unknown nope"),
    "train-eval-with-nothing": ([*TRAIN, "--eval.every", "2"], "nothing to evaluate"),
    "train-eval-missing-include-path": ([*TRAIN, "--eval.every", "2", "--eval.tasks", "[x]", "--eval.include_path",
                                         "nowhere"], "eval.include_path nowhere"),
    "train-unknown-key": ([*TRAIN, "--trainer.max_stepz", "5"], "unknown config key 'trainer.max_stepz'"),
    "train-missing-config": (["train", "--config", "nowhere.yaml"], "nowhere.yaml"),
    "train-yaml-syntax": (["train", "--config", "bad.yaml"], f"lm train: error: {IN_BAD_YAML}"),
    "train-yaml-syntax-after-a-good-file": ([*TRAIN, "--config=bad.yaml"], f"lm train: error: {IN_BAD_YAML}"),
    "train-pattern-cut-by-the-depth": ([*TRAIN, "--model.layer_pattern", THREE_TO_ONE, "--model.n_layers", "2"],
                                       "model.layer_pattern has 4 layers (gated_deltanet, gated_deltanet, "
                                       "gated_deltanet, attention), which do not tile model.n_layers 2"),
    "train-missing-data": ([*TRAIN, "--data.path", "nowhere"], "nowhere"),
    "train-zero-micro-batch": ([*TRAIN, "--data.micro_batch", "0"], "data.micro_batch"),
    "train-zero-steps": ([*TRAIN, "--trainer.max_steps", "0"], "trainer.max_steps"),
    "train-zero-width": ([*TRAIN, "--model.d_model", "0"], "model.d_model"),
    "train-seq-len-above-model": ([*TRAIN, "--data.seq_len", "128"], "max_seq_len"),
    "train-zero-devices": ([*TRAIN, "--strategy.devices", "0"], "strategy.devices"),
    "train-zero-context-parallel": ([*TRAIN, "--strategy.context_parallel", "0"], "strategy.context_parallel"),
    "train-context-parallel-not-dividing-the-world": ([*TRAIN, "--strategy.name", "ddp", "--strategy.devices", "2",
                                                       "--strategy.context_parallel", "4"],
                                                      "context_parallel 4 does not divide the 2 processes"),
    "train-context-parallel-not-dividing-the-window": ([*TRAIN, "--strategy.name", "ddp", "--strategy.devices", "3",
                                                        "--strategy.context_parallel", "3"],
                                                       "does not divide data.seq_len 32"),
    "train-context-parallel-with-in-loop-eval": ([*TRAIN, "--strategy.name", "ddp", "--strategy.devices", "2",
                                                  "--strategy.context_parallel", "2", "--eval.every", "1",
                                                  "--eval.probes", "[passkey]"], "eval.every evaluates"),
    "train-context-parallel-under-deepspeed": ([*TRAIN, "--strategy.name", "deepspeed", "--strategy.devices", "2",
                                                "--strategy.context_parallel", "2"], "needs strategy.name ddp or fsdp"),
    "train-missing-resume-checkpoint": ([*TRAIN, "--resume", "nowhere.ckpt"], "nowhere.ckpt"),
    "train-resume-last-without-checkpoint": ([*TRAIN, "--resume", "last"], "no checkpoint"),
    "train-resume-from-a-file-that-is-no-checkpoint": ([*TRAIN, "--resume", "file.txt"], "file.txt"),
    # lm export
    "export-missing-checkpoint": (["export", "--checkpoint", "nowhere.ckpt", "--out", "exported"], "nowhere.ckpt"),
    "export-out-is-a-file": (["export", "--checkpoint", "run", "--out", "file.txt"], "file.txt"),
    "export-unknown-format": (["export", "--checkpoint", "run", "--out", "exported", "--format", "onnx"], "format"),
    # lm eval ppl
    "ppl-zero-batch": (["eval", "ppl", "--checkpoint", "run", "--batch_size", "0"], "batch_size"),
    "ppl-negative-seq-len": (["eval", "ppl", "--checkpoint", "run", "--seq_len", "-4"], "seq_len"),
    "ppl-zero-max-windows": (["eval", "ppl", "--checkpoint", "run", "--max_windows", "0"], "max_windows"),
    "ppl-zero-multiple": (["eval", "ppl", "--checkpoint", "run", "--multiples", "[0]"], "multiples"),
    "ppl-missing-data": (["eval", "ppl", "--checkpoint", "run", "--data", "nowhere"], "nowhere"),
    "ppl-out-is-a-file": (["eval", "ppl", "--checkpoint", "run", "--out", "file.txt"], "file.txt"),
    "ppl-yaml-syntax": (["eval", "ppl", "--config", "bad.yaml"], f"lm eval ppl: error: {IN_BAD_YAML}"),
    # lm eval harness
    "harness-missing-checkpoint": (["eval", "harness", "--checkpoint", "nowhere", "--tasks", "[lambada_openai]"],
                                   "nowhere"),
    "harness-zero-batch": (["eval", "harness", "--checkpoint", "run", "--tasks", "[lambada_openai]",
                            "--batch_size", "0"], "batch_size"),
    "harness-negative-limit": (["eval", "harness", "--checkpoint", "run", "--tasks", "[lambada_openai]",
                                "--limit", "-1"], "limit"),
    "harness-nothing-to-run": (["eval", "harness", "--checkpoint", "run"], "nothing to run"),
    "harness-missing-include-path": (["eval", "harness", "--checkpoint", "run", "--tasks", "[lambada_openai]",
                                      "--include_path", "nowhere"], "nowhere"),
    # lm eval longctx
    "longctx-zero-samples": (["eval", "longctx", "--checkpoint", "run", "--samples", "0"], "samples"),
    "longctx-depth-above-one": (["eval", "longctx", "--checkpoint", "run", "--depths", "[1.5]"],
                                "depth must lie in [0, 1]"),
    "longctx-zero-length": (["eval", "longctx", "--checkpoint", "run", "--lengths", "[0]"], "length 0"),
    "longctx-unknown-probe": (["eval", "longctx", "--checkpoint", "run", "--probes", "[nope]"], "nope"),
    # lm eval passkey
    "passkey-zero-steps": (["eval", "passkey", "--data", "data", "--out", "pk", "--steps", "0"], "steps"),
    "passkey-width-not-a-multiple-of-32": (["eval", "passkey", "--data", "data", "--out", "pk", "--d_model", "48"],
                                           "multiple of 32"),
    "passkey-missing-data": (["eval", "passkey", "--data", "nowhere", "--out", "pk"], "nowhere"),
    "passkey-length-too-short-for-the-probe": (["eval", "passkey", "--data", "data", "--out", "pk", "--length", "16"],
                                               "length 16"),
    "passkey-out-is-a-file": (["eval", "passkey", "--data", "data", "--out", "file.txt"], "file.txt"),
    # lm eval mqar
    "mqar-unknown-mixer": (["eval", "mqar", "--mixers", "[nope]"], "nope"),
    "mqar-zero-batch": (["eval", "mqar", "--mixers", "[attention]", "--batch", "0"], "--batch"),
    "mqar-zero-steps": (["eval", "mqar", "--mixers", "[attention]", "--steps", "0"], "steps"),
    "mqar-too-many-pairs": (["eval", "mqar", "--mixers", "[attention]", "--pairs", "20"], "pairs"),
    "mqar-json-out-in-missing-folder": (["eval", "mqar", "--mixers", "[attention]", "--json_out", "nowhere/rows.json"],
                                        "nowhere"),
    # lm eval mqar-grid
    "mqar-grid-too-few-steps": (["eval", "mqar-grid", "--out", "grid", "--steps", "5"], "steps"),
    "mqar-grid-cell-out-of-range": (["eval", "mqar-grid", "--quick", "true", "--out", "grid", "--cell", "999"],
                                    "--cell 999"),
    "mqar-grid-negative-lr": (["eval", "mqar-grid", "--quick", "true", "--out", "grid", "--lrs", "[-0.001]"], "lrs"),
    "mqar-grid-out-is-a-file": (["eval", "mqar-grid", "--quick", "true", "--out", "file.txt"], "file.txt"),
    # lm eval state-tracking
    "state-tracking-unknown-task": (["eval", "state-tracking", "--tasks", "[s4]", "--out", "st"], "s4"),
    "state-tracking-unknown-model": (["eval", "state-tracking", "--models", "[deltanett]", "--out", "st"],
                                     "deltanett"),
    "state-tracking-bad-beta-range": (["eval", "state-tracking", "--models", '["deltanet@beta_range=[0,3]"]',
                                       "--out", "st"], "beta_range"),
    "state-tracking-out-is-a-file": (["eval", "state-tracking", "--models", "[deltanet]", "--out", "file.txt"],
                                     "file.txt"),
    # lm eval icl
    "icl-zero-steps": (["eval", "icl", "--out", "icl", "--steps", "0"], "steps"),
    "icl-negative-lr": (["eval", "icl", "--out", "icl", "--lr", "-1"], "--lr must be positive"),
    "icl-unknown-block": (["eval", "icl", "--out", "icl", "--blocks", "[huge]"], "blocks"),
    "icl-out-is-a-file": (["eval", "icl", "--out", "file.txt"], "file.txt"),
    # lm generate
    "generate-negative-token-count": (["generate", "--checkpoint", "run", "--max_new_tokens", "-1"],
                                      "max_new_tokens"),
    "generate-top-p-above-one": (["generate", "--checkpoint", "run", "--top_p", "1.5"], "top_p"),
    "generate-top-p-zero": (["generate", "--checkpoint", "run", "--top_p", "0"], "top_p"),
    "generate-negative-temperature": (["generate", "--checkpoint", "run", "--temperature", "-0.5"], "temperature"),
    "generate-zero-top-k": (["generate", "--checkpoint", "run", "--top_k", "0"], "top_k"),
    "generate-missing-checkpoint": (["generate", "--checkpoint", "nowhere"], "nowhere"),
    # lm bench
    "bench-train-zero-steps": (["bench", "train", "--steps", "0"], "steps"),
    "bench-mixer-zero-repeats": (["bench", "mixer", "--repeats", "0"], "repeats"),
    "bench-memory-zero-batch": (["bench", "memory", "--batch", "0"], "batch"),
    "bench-context-pieces-not-dividing": (["bench", "context", "--T", "30", "--pieces", "[1, 4]"], "--pieces"),
    "bench-context-unknown-mixer": (["bench", "context", "--mixers", "[nope]"], "--mixers"),
    "bench-plan-memory-context-not-dividing": (["bench", "plan-memory", "--configs", "[train.yaml]",
                                                "--context_parallel", "3"], "context_parallel 3 does not divide"),
    "bench-plan-memory-zero-context": (["bench", "plan-memory", "--configs", "[train.yaml]", "--context_parallel", "0"],
                                       "context_parallel must be a number"),
    "bench-data-zero-seq-len": (["bench", "data", "--seq_len", "0"], "seq_len"),
    "bench-data-missing-data": (["bench", "data", "--data", "nowhere"], "nowhere"),
    "bench-peers-zero-steps": (["bench", "peers", "--steps", "0"], "steps"),
    "bench-strategies-missing-data": (["bench", "strategies", "--data", "nowhere"], "nowhere"),
    "bench-strategies-width-not-a-multiple-of-64": (["bench", "strategies", "--data", "data", "--d_model", "100"],
                                                    "d_model"),
    "bench-hf-generate-zero-tokens": (["bench", "hf-generate", "--tokens", "0"], "tokens"),
    "bench-plan-memory-missing-config": (["bench", "plan-memory", "--configs", "[nowhere.yaml]"], "nowhere.yaml"),
    "bench-plan-memory-zero-micro-batch": (["bench", "plan-memory", "--configs", "[train.yaml]", "--micro_batch", "0"],
                                           "micro_batch"),
    "bench-compile-unknown-mixer": (["bench", "compile", "--mixers", "[nope]"], "nope"),
    "bench-checkpoint-save-width-not-a-multiple-of-64": (["bench", "checkpoint-save", "--d_model", "100"], "d_model"),
    "bench-self-check-zero-repeats": (["bench", "self-check", "--repeats", "0"], "repeats"),
    "eval-tasks-path-not-a-switch-value": (["eval", "tasks", "--path", "maybe"], "path"),
    # lm research
    "research-mesa-ablation-zero-steps": (["research", "mesa-ablation", "--out", "ablation", "--steps", "0"], "steps"),
    "research-mesa-ablation-missing-data": (["research", "mesa-ablation", "--out", "ablation", "--data", "nowhere"],
                                            "nowhere"),
    "research-test-time-missing-run": (["research", "test-time", "--runs", "[nowhere]", "--out", "tt"], "nowhere"),
    "research-test-time-negative-steps": (["research", "test-time", "--runs", "[nowhere]", "--steps", "[-1]",
                                           "--out", "tt"], "steps"),
    "research-ladder-reread-missing-report": (["research", "ladder-reread", "--fits", "nowhere/fits.json"],
                                              "nowhere/fits.json not found"),
    "research-ab-zero-repeats": (["research", "ab", "--rev", "HEAD", "--repeats", "0"], "repeats"),
    "research-ab-unknown-mixer": (["research", "ab", "--rev", "HEAD", "--mixers", "[nope]"], "nope"),
    # lm slurm submit (dry runs) and status
    "slurm-submit-zero-nodes": ([*SUBMIT, "--nodes", "0", *TRAIN_ARGS], "nodes"),
    "slurm-submit-zero-cpus": ([*SUBMIT, "--cpus_per_task", "0", *TRAIN_ARGS], "cpus_per_task"),
    "slurm-submit-negative-gpus": ([*SUBMIT, "--gpus_per_node", "-1", *TRAIN_ARGS], "gpus_per_node"),
    "slurm-submit-negative-signal": ([*SUBMIT, "--signal_seconds", "-1", *TRAIN_ARGS], "signal_seconds"),
    "slurm-submit-negative-lr": ([*SUBMIT, *TRAIN_ARGS, "--optim.lr", "-1"], "optim.lr"),
    "slurm-submit-missing-sweep": ([*SUBMIT, "--array", "nowhere.yaml"], "nowhere.yaml"),
    "slurm-submit-sweep-yaml-syntax": ([*SUBMIT, "--array", "bad.yaml"], IN_BAD_YAML),
    "slurm-submit-zero-tasks": ([*SUBMIT, "--kind", "eval", "--tasks", "0", "--", "mqar-grid", "--out", "grid"],
                                "--tasks"),
    "slurm-submit-prepare-without-tasks": ([*SUBMIT, "--kind", "prepare", "--", "--out", "prepared"], "--tasks N"),
    "slurm-submit-unknown-option": ([*SUBMIT, "--nodez", "2", *TRAIN_ARGS], "unknown config key 'nodez'"),
    "slurm-status-missing-run": (["slurm", "status", "nowhere"], "nowhere"),
    "slurm-status-run-without-jobs": (["slurm", "status", "run"], "no SLURM jobs"),
    # lm compare
    "compare-plan-negative-params": (["compare", "plan", "--params", "-1", "--out", "plan"], "params"),
    "compare-plan-unknown-arch": (["compare", "plan", "--archs", "nope", "--params", "1e6", "--out", "plan"], "nope"),
    "compare-plan-negative-lr": ([*PLAN, "--lrs", "[-0.001]"], "--lrs"),
    "compare-plan-missing-base": ([*PLAN, "--base", "nowhere.yaml"], "nowhere.yaml"),
    "compare-plan-base-yaml-syntax": ([*PLAN, "--base", "bad.yaml"], IN_BAD_YAML),
    "compare-plan-zero-global-batch": ([*PLAN, "--global_batch", "0"], "global_batch"),
    "compare-plan-out-is-a-file": ([*PLAN, "--out", "file.txt"], "file.txt"),
    "compare-report-missing-run": (["compare", "report", "nowhere"], "nowhere"),
    "compare-report-out-is-a-file": (["compare", "report", "run", "--out", "file.txt"], "file.txt"),
    "compare-report-missing-table": (["compare", "report", "run", "--tables", '{"extra": "nowhere.csv"}'],
                                     "nowhere.csv"),
    "compare-report-zero-position": (["compare", "report", "run", "--positions", "[0]"], "positions"),
    "compare-demo-negative-params": (["compare", "demo", "--out", "cdemo", "--params", "-1"], "params"),
    "compare-demo-missing-data": (["compare", "demo", "--out", "cdemo", "--data", "nowhere"], "nowhere"),
    "compare-demo-unknown-arch": (["compare", "demo", "--out", "cdemo", "--data", "data", "--archs", "[nope]"],
                                  "nope"),
    "compare-demo-zero-vocab": (["compare", "demo", "--out", "cdemo", "--vocab_size", "0"], "vocab"),
    "compare-ladder-missing-file": (["compare", "ladder", "nowhere.yaml", "--out", "ladder"], "nowhere.yaml"),
    "compare-ladder-zero-workers": (["compare", "ladder", "configs/ladder/cpu.yaml", "--out", "ladder", "--workers",
                                     "0"], "--workers"),
    "compare-ladder-out-is-a-file": (["compare", "ladder", "configs/ladder/cpu.yaml", "--out", "file.txt"],
                                     "file.txt"),
    "compare-documents-unknown-mixer": (["compare", "documents", "--out", "cdocs", "--mixers", "[nope]"], "nope"),
    "compare-documents-odd-width": (["compare", "documents", "--out", "cdocs", "--d_model", "63"], "d_model"),
    "compare-documents-missing-data": (["compare", "documents", "--out", "cdocs", "--data", "nowhere"], "nowhere"),
    # lm demo
    "demo-missing-recipe": (["demo", "--run_dir", "demo", "--recipe", "nowhere.yaml"], "nowhere.yaml"),
    "demo-unknown-mixer": (["demo", "--run_dir", "demo", "--mixer", "nope"], "nope"),
    "demo-negative-sample-tokens": (["demo", "--run_dir", "demo", "--sample_tokens", "-1"], "sample_tokens"),
    "demo-zero-steps": (["demo", "--run_dir", "demo", "--max_steps", "0"], "max_steps"),
    "demo-run-dir-is-a-file": (["demo", "--run_dir", "file.txt"], "file.txt"),
    # lm mixers
    "mixers-unknown-mixer": (["mixers", "kdaa"], "unknown mixer 'kdaa' (did you mean 'kda'?)"),
    "mixers-unknown-key": (["mixers", "kda", "--markdwn", "true"], "unknown config key 'markdwn'"),
}

def tree_state(root: Path) -> dict[str, tuple]:
    """Every directory and file under root: (kind, size, sha256); a directory's presence counts too."""
    state = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            state[os.path.relpath(Path(folder, name), root)] = ("dir",)
        for name in files:
            path = Path(folder, name)
            state[os.path.relpath(path, root)] = ("file", path.stat().st_size,
                                                  hashlib.sha256(path.read_bytes()).hexdigest())
    return state


@pytest.fixture(scope="module")
def template(kjv_data, tmp_path_factory) -> Path:
    """The working directory's contents: a run whose step-0 checkpoint is an untrained tiny model (nothing trains),
    a copy of the prepared data, a valid training config and a plain file."""
    from lm.model import LanguageModel, LMConfig
    from lm.training.checkpoint import manifest_of, write_manifest

    root = tmp_path_factory.mktemp("bad-input") / "template"
    shutil.copytree(kjv_data, root / "data")
    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copyfile(root / "data" / "tokenizer.json", run / "tokenizer.json")
    (run / "config.yaml").write_text(TRAIN_YAML.replace("run_dir: newrun", "run_dir: run"))
    config = LMConfig(vocab_size=512, d_model=32, n_layers=1, n_heads=2, head_dim=16, max_seq_len=64)
    model = LanguageModel(config)
    checkpoint = run / "checkpoints" / "step=00000000.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "hyper_parameters": {"model": asdict(config)}}, checkpoint)
    write_manifest(checkpoint, manifest_of(checkpoint))  # as StepCheckpoint completes one
    (root / "train.yaml").write_text(TRAIN_YAML)
    (root / "file.txt").write_text("a plain file where a directory is expected\n")
    (root / "bad.yaml").write_text(BAD_YAML)
    return root


def test_every_command_has_a_case():
    named = {" ".join(argv[:2]) if " ".join(argv[:2]) in COMMANDS else argv[0] for argv, _ in CASES.values()}
    assert set(COMMANDS) <= named, set(COMMANDS) - named
    assert len(CASES) >= 30


@pytest.mark.parametrize(("argv", "expected"), [pytest.param(*case, id=name)
                                                for name, case in CASES.items()])
def test_bad_input_is_one_line_exit_2_and_nothing_written(argv, expected, template, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    shutil.copytree(template, work)
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no site file of lm slurm from the user's home
    monkeypatch.delenv("LM_SLURM_SITE", raising=False)
    before = tree_state(work)
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, (code, err)
    assert len(err) == 1 and err[0].startswith("lm ") and expected in err[0], err
    assert tree_state(work) == before


def test_a_refused_resume_leaves_no_run_directory(template, tmp_path, monkeypatch, capsys):
    """FSDP2 cannot continue a plain checkpoint: `lm train` refuses in one line, and the new run directory it was
    given does not exist afterwards (nor anything else new): every check comes before the first write."""
    work = tmp_path / "work"
    shutil.copytree(template, work)
    monkeypatch.chdir(work)
    before = tree_state(work)
    code = main([*TRAIN, "--resume", "run/checkpoints/step=00000000.ckpt", "--strategy.name", "fsdp",
                 "--strategy.devices", "2", "--run_dir", "fresh"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "cannot resume FSDP2" in err[0], (code, err)
    assert not (work / "fresh").exists()
    assert tree_state(work) == before


# The everyday mistakes, each against the existing run (run_dir run): (argv, a part of the one line on stderr, whether
# the machine must have no GPU). Each is one line and exit 2, and the run's files keep their bytes and their mtimes.
IN_RUN = [*TRAIN, "--run_dir", "run"]
LAUNCH_ENV = ("SLURM_JOB_ID", "SLURM_NTASKS", "WORLD_SIZE", "MASTER_ADDR", "NODE_RANK", "TORCHELASTIC_RUN_ID")
EVERYDAY = {
    # No abbreviated keys: a typo is not taken for the key it begins.
    "train-abbreviated-key": ([*IN_RUN, "--trainer.max_step", "10"],
                              "unknown config key 'trainer.max_step' (did you mean 'trainer.max_steps'?)"),
    "command-abbreviated-key": (["eval", "ppl", "--checkpoint", "run", "--max_window", "1"],
                                "unknown config key 'max_window' (did you mean 'max_windows'?)"),
    "submit-abbreviated-key": ([*SUBMIT, "--node", "2", *TRAIN_ARGS], "unknown config key 'node'"),
    # Other tools' names for lm's keys.
    "train-learning-rate": ([*IN_RUN, "--optim.learning_rate", "1e-3"], "(did you mean 'optim.lr'?)"),
    "train-min-lr": ([*IN_RUN, "--optim.min_lr", "0.1"], "(did you mean 'optim.min_lr_ratio'?)"),
    "train-n-embd": ([*IN_RUN, "--model.n_embd", "64"], "(did you mean 'model.d_model'?)"),
    "train-batch-size": ([*IN_RUN, "--data.batch_size", "4"], "(did you mean 'data.micro_batch'?)"),
    "train-steps-elsewhere": ([*IN_RUN, "--max_iters", "10"], "(did you mean 'trainer.max_steps'?)"),
    # A value of the wrong type, in lm's words.
    "train-type-error": ([*IN_RUN, "--trainer.max_steps", "ten"], "trainer.max_steps must be an integer, got 'ten'"),
    "train-type-error-optional": ([*IN_RUN, "--trainer.accumulate", "two"],
                                  "trainer.accumulate must be an integer or null, got 'two'"),
    # What the Trainer would refuse in a traceback (or wait on forever), before anything is written.
    "train-gpu-without-one": ([*IN_RUN, "--strategy.accelerator", "gpu"], "no GPU is available here", True),
    "train-unknown-accelerator": ([*IN_RUN, "--strategy.accelerator", "tpu"], "strategy.accelerator 'tpu'"),
    "train-unknown-precision": ([*IN_RUN, "--strategy.precision", "fp8"], "strategy.precision 'fp8' is not one of"),
    "train-fsdp-precision": ([*IN_RUN, "--strategy.name", "fsdp", "--strategy.devices", "2", "--strategy.precision",
                              "64-true"], "strategy.name fsdp trains in"),
    "train-nodes-outside-a-launcher": ([*IN_RUN, "--strategy.num_nodes", "2"],
                                       "strategy.num_nodes 2 needs a launcher that starts every node"),
    "train-single-on-two-devices": ([*IN_RUN, "--strategy.name", "single", "--strategy.devices", "2"],
                                    "strategy.name single needs one device"),
    "train-fsdp-devices-auto": ([*IN_RUN, "--strategy.name", "fsdp", "--strategy.devices", "auto"],
                                "strategy.name fsdp needs strategy.devices as a number"),
    # Options for a mixer the model does not use.
    "train-options-of-an-unused-mixer": ([*IN_RUN, "--model.mixer", "gated_deltanet", "--model.mixer_options",
                                          "{mesa: {cg_steps: 5}}"],
                                         "model.mixer_options.mesa: the model does not use mesa (its mixers: "
                                         "gated_deltanet)"),
    # A misspelt command or group.
    "misspelt-group": (["evl", "ppl"], "lm: error: unknown command 'evl'; did you mean 'eval'?"),
    "misspelt-command": (["eval", "pll", "--checkpoint", "run"], "lm eval: error: unknown command 'eval pll'; "
                         "did you mean 'ppl'?"),
    "command-without-its-group": (["ppl", "--checkpoint", "run"], "unknown command 'ppl'; did you mean 'eval ppl'?"),
}


def tree_times(root: Path) -> dict[str, int]:
    return {os.path.relpath(Path(folder, name), root): Path(folder, name).stat().st_mtime_ns
            for folder, dirs, files in os.walk(root) for name in dirs + files}


@pytest.mark.parametrize(("argv", "expected", "needs_no_gpu"), [
    pytest.param(*case, *([False] if len(case) == 2 else []), id=name) for name, case in EVERYDAY.items()])
def test_an_everyday_mistake_is_one_line_exit_2_and_the_run_untouched(argv, expected, needs_no_gpu, template,
                                                                      tmp_path, monkeypatch, capsys):
    if needs_no_gpu and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    work = tmp_path / "work"
    shutil.copytree(template, work)
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LM_SLURM_SITE", raising=False)
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    before, times = tree_state(work), tree_times(work)
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, (code, err)
    assert len(err) == 1 and err[0].startswith(("lm ", "lm: ")) and expected in err[0], err
    assert tree_state(work) == before and tree_times(work) == times


def test_more_gpus_than_the_machine_has_is_refused_before_anything_is_written(template, tmp_path, monkeypatch,
                                                                                capsys):
    work = tmp_path / "work"
    shutil.copytree(template, work)
    monkeypatch.chdir(work)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    before, times = tree_state(work), tree_times(work)
    code = main([*IN_RUN, "--strategy.accelerator", "gpu", "--strategy.devices", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "strategy.devices 2: this machine has 1 GPU(s)" in err[0], (code, err)
    assert tree_state(work) == before and tree_times(work) == times


def test_several_nodes_need_a_launcher():
    """Outside SLURM and torchrun, a multi-node run would wait for the other nodes forever: refused. Any launcher's
    environment (a SLURM job, torchrun's, nodes started by hand with MASTER_ADDR and NODE_RANK) is left to it."""
    from lm.training.launch_guard import check_nodes_launch
    from lm.util.errors import UserError

    check_nodes_launch(1, {})
    for env in ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2"}, {"WORLD_SIZE": "2", "RANK": "0"},
                {"MASTER_ADDR": "node0", "NODE_RANK": "1"}, {"TORCHELASTIC_RUN_ID": "x"}):
        check_nodes_launch(2, env)
    with pytest.raises(UserError, match="lm slurm submit"):
        check_nodes_launch(2, {"LOCAL_RANK": "0"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="16-mixed is fp16 AMP on a GPU")
def test_a_silent_change_is_said_once(template, monkeypatch, capsys):
    """16-mixed on the CPU trains in bf16-mixed (as Lightning would): said in one line on stderr."""
    from lm.training.config import parse_run_config
    from lm.training.launch_guard import check_launch

    monkeypatch.chdir(template)
    config, _, _ = parse_run_config(["--config", "train.yaml", "--strategy.precision", "16-mixed"])
    assert config.strategy.resolved_precision == "bf16-mixed"
    check_launch(config)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["lm train: warning: strategy.precision 16-mixed (fp16 AMP) is not available on the CPU; training "
                   "in bf16-mixed, as Lightning does"], err
    config, _, _ = parse_run_config(["--config", "train.yaml", "--strategy.precision", "32-true"])
    check_launch(config)
    assert capsys.readouterr().err == ""


def test_options_in_a_config_file_for_a_mixer_the_model_does_not_use_are_refused(template, tmp_path, monkeypatch,
                                                                                  capsys):
    monkeypatch.chdir(template)
    base = tmp_path / "base.yaml"
    base.write_text(TRAIN_YAML.replace("model: {", "model: {mixer_options: {swa: {window: 8}}, "))
    before = tree_state(template)
    assert main(["train", "--config", str(base), "--run_dir", "run"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "lm train: error: model.mixer_options.swa: the model does not use swa (its mixers: attention)"]
    assert tree_state(template) == before


def test_a_site_file_with_a_yaml_syntax_error_is_named_with_its_line(template, tmp_path, monkeypatch, capsys):
    """lm slurm submit reads its site file (LM_SLURM_SITE) itself, as defaults: a syntax error there names it too."""
    monkeypatch.chdir(template)
    monkeypatch.setenv("LM_SLURM_SITE", "bad.yaml")
    before = tree_state(template)
    assert main([*SUBMIT, *TRAIN_ARGS]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"lm slurm submit: error: {IN_BAD_YAML}"), err
    assert tree_state(template) == before


def test_slurm_submit_takes_dry_run_as_its_help_shows(template, tmp_path, monkeypatch, capsys):
    """`--dry_run true` (the form --help shows), `--dry-run` and `--dry_run` alone all print the script and submit
    nothing; what they write is what the printed script needs (the frozen config and the log folder, under the run
    directory's slurm/), and nothing else changes."""
    work = tmp_path / "work"
    shutil.copytree(template, work)
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LM_SLURM_SITE", raising=False)
    before = tree_state(work)
    for flag in (["--dry_run", "true"], ["--dry-run"], ["--dry_run"], ["--dry-run", "true", "--exclusive", "true"]):
        code = main(["slurm", "submit", *flag, *TRAIN_ARGS])
        captured = capsys.readouterr()
        assert code == 0 and "#SBATCH" in captured.out, (flag, code, captured.err)
    after = tree_state(work)
    assert {path: state for path, state in after.items() if path in before} == before
    written = {Path(path) for path in after.keys() - before.keys()} - {Path("newrun")}  # the run directory
    assert written and all(path.parts[:2] == ("newrun", "slurm") for path in written), written
