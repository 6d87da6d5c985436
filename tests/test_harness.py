"""The lm-eval adapter (lm/eval/harness.py): log-likelihoods equal the model's own token-by-token sum, batch size
does not change any score for any mixer, rolling windows cover a long text, and generation stops where asked."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model
from tokenizers import Tokenizer

from lm.eval.harness import LMHarness
from lm.mixers import MIXERS
from lm.model import LanguageModel, LMConfig

TEXTS = [("In the beginning", " God created the heaven"), ("And the earth was", " without form, and void"),
         ("", "And God said, Let there be light"), ("And God saw the light, that it was ", "good"),
         ("Let there be", " a firmament in the midst of the waters, and let it divide the waters"),
         ("And the evening and the morning were the", " first day")]


@pytest.fixture(scope="module")
def tokenizer(kjv_data) -> Tokenizer:
    return Tokenizer.from_file(str(Path(kjv_data) / "tokenizer.json"))


def tiny(mixer: str, max_seq_len: int = 64) -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(LMConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=2, head_dim=16,
                                  max_seq_len=max_seq_len, mixer=mixer)).eval()


def requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def harness(model, tokenizer, batch_size: int = 1, **kwargs) -> LMHarness:
    return LMHarness(model=model, tokenizer=tokenizer, batch_size=batch_size, **kwargs)


def test_the_model_is_registered_with_lm_eval():
    assert get_model("lm") is LMHarness


def test_an_installed_lm_is_found_by_lm_evals_registry_alone():
    """The .pth file that installing `lm` adds registers the model before anything of lm is imported."""
    import subprocess
    import sys

    code = ("import sys; from lm_eval.api.registry import get_model; assert 'lm.eval.harness' not in sys.modules; "
            "print(get_model('lm').__module__, get_model('dummy').__name__)")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert found.stdout.split() == ["lm.eval.harness", "DummyLM"]


def test_loglikelihood_is_the_models_own_sum_of_token_log_probabilities(tokenizer):
    model = tiny("attention")
    scores = harness(model, tokenizer, batch_size=3).loglikelihood(requests("loglikelihood", TEXTS))
    sep = tokenizer.token_to_id("<|endoftext|>") or harness(model, tokenizer).sep
    for (context, continuation), (score, greedy) in zip(TEXTS, scores):
        # Independently: feed the tokens one at a time with the carried state, and add up log p of each
        # continuation token (the continuation is what the whole text has beyond the context's tokens).
        stripped = context.rstrip()
        whole = tokenizer.encode(stripped + context[len(stripped):] + continuation, add_special_tokens=False).ids
        n_context = len(tokenizer.encode(stripped, add_special_tokens=False).ids)
        tokens, state, total, all_greedy = [sep] + whole, None, 0.0, True
        with torch.no_grad():
            for t in range(len(tokens) - 1):
                logits, state = model(torch.tensor([[tokens[t]]]), state)
                if t + 1 > n_context:
                    logprobs = F.log_softmax(logits[0, -1].double(), dim=-1)
                    total += float(logprobs[tokens[t + 1]])
                    all_greedy &= int(logprobs.argmax()) == tokens[t + 1]
        assert score == pytest.approx(total, abs=1e-4)
        assert greedy == all_greedy


@pytest.mark.parametrize("mixer", sorted(MIXERS))
def test_scores_do_not_depend_on_the_batch_size(tokenizer, mixer):
    model = tiny(mixer)
    one, four = harness(model, tokenizer, batch_size=1), harness(model, tokenizer, batch_size=4)
    pairs = requests("loglikelihood", TEXTS)
    texts = requests("loglikelihood_rolling", [(c + x,) for c, x in TEXTS])
    # Equal up to float32 rounding: a batch of 4 runs matmuls of other shapes. A pad that leaked into a real
    # token's logits, or into a recurrent state, would move a score by far more.
    (scores_1, greedy_1), (scores_4, greedy_4) = (zip(*lm.loglikelihood(pairs)) for lm in (one, four))
    assert scores_4 == pytest.approx(scores_1, rel=1e-5, abs=1e-5) and greedy_4 == greedy_1
    assert four.loglikelihood_rolling(texts) == pytest.approx(one.loglikelihood_rolling(texts), rel=1e-5)


def test_rolling_windows_score_every_token_of_a_long_text_once(tokenizer):
    model = tiny("gated_deltanet", max_seq_len=512)
    text = " ".join(c + x for c, x in TEXTS) * 3
    n_tokens = len(tokenizer.encode(text, add_special_tokens=False).ids)
    whole = harness(model, tokenizer).loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))[0]
    windowed = harness(model, tokenizer, max_length=32).loglikelihood_rolling(
        requests("loglikelihood_rolling", [(text,)]))[0]
    assert n_tokens > 3 * 32  # several windows
    # One pass over the whole text equals the loglikelihood of the text after nothing; the windows lose
    # context, so they differ, but both count every token once: their per-token means are close.
    assert whole == pytest.approx(harness(model, tokenizer).loglikelihood(
        requests("loglikelihood", [("", text)]))[0][0], abs=1e-3)
    assert windowed / n_tokens == pytest.approx(whole / n_tokens, rel=0.05)


@pytest.mark.parametrize("mixer", ["attention", "mesa"])
def test_generation_is_the_greedy_continuation_cut_at_the_stop_string(tokenizer, mixer):
    model = tiny(mixer)
    lm = harness(model, tokenizer)
    context = "And God said"
    prompt = torch.tensor([[lm.sep] + tokenizer.encode(context, add_special_tokens=False).ids])
    greedy = model.generate(prompt, 12, temperature=0)[0, prompt.shape[1]:].tolist()
    free_text = tokenizer.decode([t for t in greedy if t != lm.sep][:12])
    stop = free_text[len(free_text) // 2:][:2] or "zz"
    out = lm.generate_until(requests("generate_until", [(context, {"until": [stop], "max_gen_toks": 12}),
                                                        (context, {"until": [], "max_gen_toks": 12})]))
    assert out[0] == free_text.split(stop)[0] and stop not in out[0]
    assert free_text.startswith(out[1]) and len(out[1]) >= len(out[0])


FIXTURE_TASKS = {
    "lm_fixture_choice": """task: lm_fixture_choice
dataset_path: json
dataset_kwargs: {{data_files: {{test: {dir}/choice.jsonl}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list: [{{metric: acc}}, {{metric: acc_norm}}]
""",
    "lm_fixture_rolling": """task: lm_fixture_rolling
dataset_path: json
dataset_kwargs: {{data_files: {{test: {dir}/text.jsonl}}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list: [{{metric: word_perplexity}}, {{metric: bits_per_byte}}]
""",
    "lm_fixture_generate": """task: lm_fixture_generate
dataset_path: json
dataset_kwargs: {{data_files: {{test: {dir}/choice.jsonl}}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs: {{until: ["."], max_gen_toks: 8}}
metric_list: [{{metric: exact_match}}]
""",
}


@pytest.fixture(scope="module")
def fixture_tasks(tmp_path_factory) -> Path:
    """Three local lm-eval tasks, one per output type, over jsonl written here (nothing is downloaded)."""
    import json

    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    with open(folder / "choice.jsonl", "w") as f:
        for context, continuation in TEXTS:
            f.write(json.dumps({"context": context or "And", "choices": [continuation, " the waters"],
                                "answer": 0}) + "\n")
    with open(folder / "text.jsonl", "w") as f:
        for context, continuation in TEXTS:
            f.write(json.dumps({"text": context + continuation}) + "\n")
    for name, text in FIXTURE_TASKS.items():
        (folder / f"{name}.yaml").write_text(text.format(dir=folder))
    return folder


@pytest.fixture(scope="module")
def trained_run(kjv_data, tmp_path_factory) -> Path:
    """A tiny attention model trained for a few steps with `lm train` (in this process: a fresh one would spend more
    time importing than training)."""
    from lm.cli import main

    tmp = tmp_path_factory.mktemp("harness-run")
    config = tmp / "run.yaml"
    config.write_text(f"""
model: {{vocab_size: 512, d_model: 32, n_layers: 2, n_heads: 2, head_dim: 16, max_seq_len: 64}}
data: {{path: {kjv_data}, seq_len: 64, micro_batch: 4, num_workers: 0, val_windows: 4}}
trainer: {{max_steps: 4, val_every: 1000, ckpt_every: 4, log_every: 1, progress_bar: false}}
strategy: {{accelerator: cpu}}
run_dir: {tmp / "run"}
""")
    assert main(["train", "--config", str(config)]) == 0
    return tmp / "run"


@pytest.fixture(scope="module")
def lm_scores(trained_run, fixture_tasks) -> dict:
    """lm-eval's simple_evaluate of the three fixture tasks on the trained checkpoint, `--model lm` by name, samples
    logged: what lm-eval's command line and its `hf` model on the export must reproduce (run once for both tests)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(fixture_tasks), include_defaults=False)  # lm-eval's own: 10 s to index
    return lm_eval.simple_evaluate(
        model="lm", model_args=f"checkpoint={trained_run},batch_size=4,device=cpu", tasks=list(FIXTURE_TASKS),
        task_manager=manager, bootstrap_iters=0, log_samples=True)


def test_lm_eval_runs_the_three_output_types_offline_on_a_trained_checkpoint(trained_run, fixture_tasks, lm_scores):
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(fixture_tasks), include_defaults=False)
    results = lm_scores["results"]
    assert 0 <= results["lm_fixture_choice"]["acc,none"] <= 1
    assert results["lm_fixture_rolling"]["word_perplexity,none"] > 1
    assert results["lm_fixture_generate"]["exact_match,none"] in (0.0, 1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, 1.0)
    # The same scores through the Python API with a model object: the checkpoint loads as the model it is.
    again = lm_eval.simple_evaluate(
        model=LMHarness(checkpoint=str(trained_run), batch_size=1), tasks=["lm_fixture_choice"],
        task_manager=manager, bootstrap_iters=0)["results"]
    assert again["lm_fixture_choice"]["acc,none"] == results["lm_fixture_choice"]["acc,none"]
    # And through lm-eval's own command line, which finds the installed model by name.
    cli = run_lm_eval_cli(trained_run, fixture_tasks, list(FIXTURE_TASKS))
    for task, values in results.items():
        for metric, value in values.items():
            if isinstance(value, float) and "stderr" not in metric:
                assert cli[task][metric] == pytest.approx(value, rel=1e-6), (task, metric)


def run_lm_eval_cli(run: Path, include_path: Path, tasks: list[str], model: str = "lm") -> dict:
    """`lm_eval --model lm ...` (or `--model hf` on a Hugging Face directory) in a subprocess; its results.json."""
    import subprocess
    import sys

    out = include_path / f"cli-out-{model}"
    model_args = f"checkpoint={run}" if model == "lm" else f"pretrained={run},dtype=float32"
    lm_eval_cli = Path(sys.executable).parent / "lm_eval"
    done = subprocess.run([str(lm_eval_cli), "--model", model, "--model_args", model_args, "--batch_size", "4",
                           "--device", "cpu", "--tasks", ",".join(tasks), "--include_path", str(include_path),
                           "--output_path", str(out), "--log_samples"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    (results,) = out.rglob("results*.json")
    samples = {task: [json.loads(line) for line in next(out.rglob(f"samples_{task}_*.jsonl")).open()]
               for task in tasks}
    return {**json.loads(results.read_text())["results"], "samples": samples}


def test_lm_evals_hf_model_scores_the_hf_export_as_the_lm_model_scores_the_checkpoint(trained_run, fixture_tasks,
                                                                                     lm_scores, tmp_path):
    """`lm export --format hf`, then lm-eval's own `hf` model on the directory (transformers finds the classes
    through the start-up hook): the multiple-choice accuracies and the generations score as `--model lm` does."""
    import shutil

    from lm.cli import main

    without_tokenizer = shutil.copytree(trained_run, tmp_path / "run", ignore=shutil.ignore_patterns("tokenizer.json"))
    assert main(["export", "--checkpoint", str(without_tokenizer), "--out", str(tmp_path / "x"), "--format", "hf"]) == 2
    assert not (tmp_path / "x").exists()
    assert main(["export", "--checkpoint", str(trained_run), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    tasks = ["lm_fixture_choice", "lm_fixture_generate"]
    hf = run_lm_eval_cli(tmp_path / "hf", fixture_tasks, tasks, model="hf")
    ours = lm_scores  # simple_evaluate's `--model lm` on the checkpoint, these two tasks among its three
    for task, metric in (("lm_fixture_choice", "acc,none"), ("lm_fixture_choice", "acc_norm,none"),
                         ("lm_fixture_generate", "exact_match,none")):
        assert hf[task][metric] == ours["results"][task][metric], (task, metric)
    # Not only the accuracies: each choice's log-likelihood (lm-eval writes them as strings) and each generation.
    for task in tasks:
        theirs = {s["doc_id"]: s["filtered_resps"] for s in hf["samples"][task]}
        for sample in ours["samples"][task]:
            if task == "lm_fixture_choice":
                assert [float(r[0]) for r in theirs[sample["doc_id"]]] == pytest.approx(
                    [r[0] for r in sample["filtered_resps"]], rel=1e-5)
            else:
                assert theirs[sample["doc_id"]] == sample["filtered_resps"]


def test_lm_eval_harness_command_writes_results_into_the_run(trained_run, fixture_tasks, capsys):
    """`lm eval harness` as its command line runs it (in this process: a fresh one would mostly import; lm-eval's
    registry in a fresh interpreter is test_an_installed_lm_is_found_by_lm_evals_registry_alone's)."""
    from lm.cli import main

    capsys.readouterr()
    assert main(["eval", "harness", "--checkpoint", str(trained_run), "--tasks",
                 "[lm_fixture_choice, lm_fixture_rolling]", "--include_path", str(fixture_tasks),
                 "--batch_size", "2"]) == 0
    printed, said = capsys.readouterr()
    out = trained_run / "eval" / "harness-tasks"
    assert f"lm eval harness: wrote results.json and results.md in {out}\n" in said  # where, on stderr
    table = (out / "results.md").read_text()
    assert "| lm_fixture_choice | acc_norm |" in table and "| lm_fixture_rolling | word_perplexity |" in table
    assert table in printed
    assert set(json.loads((out / "results.json").read_text())["results"]) == {"lm_fixture_choice",
                                                                            "lm_fixture_rolling"}


def test_a_suite_whose_data_is_missing_offline_names_the_task(trained_run, monkeypatch):
    import lm_eval.tasks

    from lm.eval.run_harness import harness as run_harness
    from lm.util.errors import UserError

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # lm-eval's index of its own thousands of task YAMLs (about 10 s) is built once for both failing calls below, not
    # once per call: the same arguments give the same index.
    made, task_manager = {}, lm_eval.tasks.TaskManager

    def once(*args, **kwargs):
        key = repr((args, kwargs))
        if key not in made:
            made[key] = task_manager(*args, **kwargs)
        return made[key]

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", once)
    with pytest.raises(UserError, match="task wikitext: its data could not be loaded"):
        run_harness(str(trained_run), suite="standard")
    with pytest.raises(UserError, match="unknown lm-eval task"):
        run_harness(str(trained_run), tasks=["no_such_task"])
    with pytest.raises(UserError, match="suite nope not found"):
        run_harness(str(trained_run), suite="nope")


def test_based_in_context_tasks_put_the_passage_before_the_question_and_score_containment():
    import importlib.util

    from lm.util.resources import shipped

    # lm-eval loads a task folder's utils.py by path (`!function utils.doc_to_text`), and so does this test.
    spec = importlib.util.spec_from_file_location("based_recall_utils", shipped("eval/tasks/based_recall/utils.py"))
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    doc_to_text, process_results = utils.doc_to_text, utils.process_results

    doc = {"context": "[DOC] [TLE] Paris [PAR] Paris is the capital of France. What is the capital of France?",
           "question": "What is the capital of France?", "answers": ["Paris", "City of Light"]}
    assert doc_to_text(doc) == "Paris  Paris is the capital of France. What is the capital of France?"
    assert process_results(doc, [" paris, of course"]) == {"contains": 1.0}
    assert process_results(doc, [" Lyon"]) == {"contains": 0.0}


def test_the_based_task_yamls_run_through_lm_eval_on_local_data(trained_run, tmp_path):
    """Each Based YAML, with only its dataset swapped for a local jsonl of the same fields, runs end to end."""
    from lm.eval.run_harness import TASKS
    from lm.eval.run_harness import harness as run_harness

    data = tmp_path / "based.jsonl"
    data.write_text("".join(json.dumps({"context": f"{c} {x}.", "question": f"{c}?", "answers": [x.strip()]}) + "\n"
                            for c, x in TEXTS))
    names = []
    for yaml_file in sorted((TASKS / "based_recall").glob("*.yaml")):
        names.append(f"{yaml_file.stem}_local")
        (tmp_path / f"{names[-1]}.yaml").write_text(
            f"include: {yaml_file}\ntask: {names[-1]}\ndataset_path: json\n"
            f"dataset_kwargs: {{data_files: {{validation: {data}}}}}\n")
    results = run_harness(str(trained_run), tasks=names, include_path=str(tmp_path), out=str(tmp_path / "out"))
    assert set(results) == set(names)
    assert all(0 <= results[name]["contains,none"] <= 1 for name in names)
