"""The lm-eval model `lm` (lm/eval/harness.py) without a device: CUDA where there is CUDA, else the CPU, also when it
comes through lm_eval's command line, which passes its own default ("cuda:0") when --device is not given."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lm_eval.api.registry import get_model
from lm_eval.config.evaluate_config import EvaluatorConfig
from tokenizers import Tokenizer

from lm.eval.harness import LMHarness
from lm.export import save_pretrained
from lm.model import LanguageModel, LMConfig

EXPECTED = "cuda" if torch.cuda.is_available() else "cpu"
TASK = """task: lm_device_probe
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list: [{{metric: acc}}]
"""


@pytest.fixture(scope="module")
def exported(kjv_data, tmp_path_factory) -> Path:
    """A tiny untrained model as `lm export` writes it, with the corpus's tokenizer."""
    torch.manual_seed(0)
    config = LMConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=2, head_dim=16, max_seq_len=64)
    out = tmp_path_factory.mktemp("harness-device") / "export"
    return save_pretrained(LanguageModel(config).state_dict(), config, out, Path(kjv_data) / "tokenizer.json")


def test_without_a_device_the_model_lands_on_cuda_only_where_there_is_cuda(exported):
    lm_eval_default = EvaluatorConfig().device  # what `lm_eval` passes when --device is not given
    for harness in (get_model("lm").create_from_arg_string(f"checkpoint={exported}", {"device": lm_eval_default}),
                    LMHarness(checkpoint=str(exported))):
        assert harness.device.type == EXPECTED
        assert {p.device.type for p in harness.model.parameters()} == {EXPECTED}
    assert LMHarness(checkpoint=str(exported), device="cpu").device == torch.device("cpu")  # a given one is kept
    # A model object stays where it is.
    model = LanguageModel.from_pretrained(str(exported))
    tokenizer = Tokenizer.from_file(str(exported / "tokenizer.json"))
    assert LMHarness(model=model, tokenizer=tokenizer).device == torch.device("cpu")
    assert next(model.parameters()).device == torch.device("cpu")


def test_lm_eval_command_line_without_device_runs(exported, tmp_path):
    """`lm_eval --model lm` with no --device, as the issue ran it: on a machine without CUDA it failed with "Torch
    not compiled with CUDA enabled"."""
    (tmp_path / "probe.jsonl").write_text(
        json.dumps({"context": "In the beginning", "choices": [" God", " the waters"], "answer": 0}) + "\n")
    (tmp_path / "lm_device_probe.yaml").write_text(TASK.format(data=tmp_path / "probe.jsonl"))
    lm_eval_cli = Path(sys.executable).parent / "lm_eval"
    done = subprocess.run([str(lm_eval_cli), "--model", "lm", "--model_args", f"checkpoint={exported}", "--tasks",
                           "lm_device_probe", "--include_path", str(tmp_path), "--output_path", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (results,) = (tmp_path / "out").rglob("results*.json")
    assert json.loads(results.read_text())["results"]["lm_device_probe"]["acc,none"] in (0.0, 1.0)
    if EXPECTED == "cpu":
        assert "lm: no CUDA on this machine: evaluating on the CPU, not on cuda:0" in done.stderr
