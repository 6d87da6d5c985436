"""The Hugging Face format (lm/hf): every mixer and hybrid loads through AutoModelForCausalLM in a fresh process with
the exported model's exact logits (its weights and whole config survive the export), greedy `generate` is the
exported model's, left padding changes no real token, the cache of a recurrent mixer stays the same size while an
attention cache grows, and bad directories are one line."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from lm.compare.paper_sizes import HYBRIDS
from lm.data_prep.tokenizer import separator
from lm.hf.cache import LMCache
from lm.hf.export import save_hf
from lm.hf.model import padding_resets
from lm.mixers import MIXERS
from lm.model import LanguageModel, LMConfig

ARCHS = {**{name: None for name in MIXERS}, **HYBRIDS, "custom": None}  # name -> layer pattern
TEXTS = ["In the beginning God created the heaven and the earth.", "And God said"]


def tiny_config(arch: str, **options) -> LMConfig:
    pattern = ARCHS[arch]
    return LMConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=2, head_dim=16, max_seq_len=64,
                    mixer=pattern.split(",")[0] if pattern else arch, layer_pattern=pattern, **options)


def custom_config(separator: int) -> LMConfig:
    """A hybrid with every LMConfig field away from its default (a field the export drops comes back as its default,
    and then differs): an untied head, a strong soft cap, mixer options that change the function (rotary theta,
    grouped-query heads, Mesa's CG steps and output gate), and resets at the tokenizer's separator."""
    return LMConfig(vocab_size=512, d_model=32, n_layers=4, n_heads=2, head_dim=16, mixer="hawk",
                    mixer_options={"attention": {"rope_theta": 500.0, "n_kv_heads": 1},
                                   "mesa": {"cg_steps": 12, "output_gate": True}, "hawk": {"expand": 1.0}},
                    layer_pattern="hawk,mesa,attention", cycle_pattern=True, mlp_ratio=2.5, tie_embeddings=False,
                    logit_soft_cap=5.0, max_seq_len=48, norm_eps=1e-5, init_std=0.05, document_separator=separator)


def tiny_model(config: LMConfig) -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(config).eval()


def export_tiny(config: LMConfig, out: Path, tokenizer: Path) -> Path:
    return save_hf(tiny_model(config).state_dict(), config, out, tokenizer)


@pytest.fixture(scope="module")
def originals(kjv_data) -> dict[str, LanguageModel]:
    """The in-memory models that `exported` writes: what every export must reproduce, bit for bit."""
    _, sep = separator(Tokenizer.from_file(str(Path(kjv_data) / "tokenizer.json")))
    return {arch: tiny_model(custom_config(sep) if arch == "custom" else tiny_config(arch)) for arch in ARCHS}


@pytest.fixture(scope="module")
def exported(originals, kjv_data, tmp_path_factory) -> dict[str, Path]:
    """A randomly initialised tiny model of every mixer and hybrid, and the custom hybrid, written with save_hf (what
    `lm export --format hf` calls; test_harness.py exports a trained checkpoint through the command)."""
    folder = tmp_path_factory.mktemp("hf")
    return {arch: save_hf(model.state_dict(), model.cfg, folder / arch, Path(kjv_data) / "tokenizer.json")
            for arch, model in originals.items()}


FRESH_PROCESS = """
import sys, torch
assert "lm.model" not in sys.modules and "lm.hf.model" not in sys.modules
from transformers import AutoModelForCausalLM, AutoTokenizer
for directory in sys.argv[1:]:
    model, tokenizer = AutoModelForCausalLM.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    two = torch.cat([ids, ids], dim=1)  # two documents in one row: the separator starts the second one too
    with torch.no_grad():
        torch.save({"ids": ids, "logits": model(ids).logits, "two": model(two).logits}, directory + "/hf.pt")
    print(type(model).__name__, model.training)
"""


def test_every_mixer_and_hybrid_loads_through_the_auto_classes_with_the_original_models_logits(originals, exported):
    """In a fresh process that imports nothing of lm: the classes come from the start-up hook that installing lm
    adds. The logits are those of the model that was exported (the in-memory original, not a reload of the export),
    exactly: float32 weights go through the export bit for bit, and the model is built from the same config."""
    code = FRESH_PROCESS.replace("TEXT", repr(TEXTS[0]))
    run = subprocess.run([sys.executable, "-c", code, *map(str, exported.values())], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split("\n")[:len(exported)] == ["LMForCausalLM False"] * len(exported)
    for arch, directory in exported.items():
        saved = torch.load(directory / "hf.pt")
        sep = AutoTokenizer.from_pretrained(directory).bos_token_id
        assert saved["ids"][0, 0].item() == sep  # the tokenizer starts every text with the separator, as lm does
        with torch.no_grad():
            expected = originals[arch](saved["ids"])[0]
            two = originals[arch](torch.cat([saved["ids"], saved["ids"]], dim=1))[0]
        torch.testing.assert_close(saved["logits"], expected, rtol=0, atol=0, msg=arch)
        torch.testing.assert_close(saved["two"], two, rtol=0, atol=0, msg=arch)
    # With resets at the separator, the second document's logits are the first's; without, they are not.
    custom = torch.load(exported["custom"] / "hf.pt")
    n = custom["ids"].shape[1]
    torch.testing.assert_close(custom["two"][:, n:], custom["logits"], rtol=0, atol=1e-5)
    plain = torch.load(exported["hawk_mesa"] / "hf.pt")
    assert (plain["two"][:, n:] - plain["logits"]).abs().max() > 1e-3


def test_the_export_holds_the_original_weights_and_every_config_field(originals, exported):
    """model.safetensors holds every tensor of the original bit for bit, and config.json its whole LMConfig: the
    custom config has every field away from its default, so a field the export drops (or the loader ignores) comes
    back different. AutoModelForCausalLM builds its LanguageModel from that config, with those weights."""
    from transformers import AutoConfig

    custom = originals["custom"].cfg
    for field in dataclasses.fields(LMConfig):
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        assert getattr(custom, field.name) != default, field.name
    for arch, model in originals.items():
        original = model.state_dict()
        weights = load_file(str(exported[arch] / "model.safetensors"))
        assert sorted(weights) == sorted("model." + name for name in original), arch
        for name, tensor in original.items():
            assert tensor.dtype == weights["model." + name].dtype == torch.float32, (arch, name)
            assert torch.equal(weights["model." + name], tensor), (arch, name)
        config = json.loads((exported[arch] / "config.json").read_text())
        assert config["lm"] == dataclasses.asdict(model.cfg), arch
        assert LMConfig(**AutoConfig.from_pretrained(exported[arch]).lm) == model.cfg, arch
    loaded = AutoModelForCausalLM.from_pretrained(exported["custom"])
    assert loaded.model.cfg == custom and loaded.model.head is not None
    theirs = originals["custom"].state_dict()
    assert loaded.model.state_dict().keys() == theirs.keys()
    for name, ours in loaded.model.state_dict().items():
        assert torch.equal(ours, theirs[name]), name


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_generate_is_the_original_models_generate(originals, exported, arch):
    """20 tokens at temperature 0: the same tokens as the exported model's LanguageModel.generate, and at every step
    the logits that it gives the whole sequence at once (so the HF cache carries the whole state, not just the
    token)."""
    model = AutoModelForCausalLM.from_pretrained(exported[arch])
    tokenizer = AutoTokenizer.from_pretrained(exported[arch])
    ids = tokenizer(TEXTS[1], return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=20, do_sample=False, output_logits=True, return_dict_in_generate=True)
    reference = originals[arch]
    expected = reference.generate(ids, 20, temperature=0, eos_id=tokenizer.eos_token_id)
    assert out.sequences.tolist() == expected.tolist()
    assert out.sequences.shape[1] == ids.shape[1] + 20  # no early separator: all 20 steps were compared
    with torch.no_grad():
        whole = reference(out.sequences)[0][0, ids.shape[1] - 1:-1]
    torch.testing.assert_close(torch.cat(out.logits), whole, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_left_padded_batch_gives_each_row_its_own_logits_in_prefill_and_decoding(exported, arch):
    model = AutoModelForCausalLM.from_pretrained(exported[arch])
    tokenizer = AutoTokenizer.from_pretrained(exported[arch], padding_side="left")
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    assert not batch["attention_mask"][1].all()  # the second row is padded
    next_token = torch.tensor([[5], [7]])
    with torch.no_grad():
        padded = model(**batch)
        mask = torch.cat([batch["attention_mask"], torch.ones(2, 1, dtype=torch.long)], dim=1)
        padded_next = model(next_token, attention_mask=mask, cache=padded.cache).logits
        for row, text in enumerate(TEXTS):
            alone = model(**tokenizer(text, return_tensors="pt"))
            n = alone.logits.shape[1]
            torch.testing.assert_close(padded.logits[row, -n:], alone.logits[0], rtol=0, atol=1e-5)
            alone_next = model(next_token[row:row + 1], cache=alone.cache).logits
            torch.testing.assert_close(padded_next[row], alone_next[0], rtol=0, atol=1e-5)


def test_padding_resets_only_left_padded_rows_and_refuses_holes():
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [1, 1, 0, 0]])
    assert padding_resets(mask).tolist() == [[False] * 4, [False, False, True, False], [False] * 4]
    assert padding_resets(torch.ones(2, 3, dtype=torch.long)) is None
    with pytest.raises(ValueError, match="between real tokens"):
        padding_resets(torch.tensor([[1, 0, 1]]))


def test_labels_give_the_mean_next_token_cross_entropy(exported):
    model = AutoModelForCausalLM.from_pretrained(exported["gated_deltanet"])
    ids = AutoTokenizer.from_pretrained(exported["gated_deltanet"])(TEXTS[0], return_tensors="pt")["input_ids"]
    labels = ids.clone()
    labels[0, :3] = -100
    out = model(ids, labels=labels)
    expected = F.cross_entropy(out.logits[0, :-1], labels[0, 1:], ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)


def cache_sizes_while_generating(model, ids, tokens: int) -> list[int]:
    """LMCache.nbytes after every forward call of model.generate (the prefill, then one call per token)."""
    sizes = []
    hook = model.register_forward_hook(lambda module, args, out: sizes.append(out.cache.nbytes()))
    model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    hook.remove()
    return sizes


def test_a_recurrent_cache_stays_one_size_while_attentions_grows_and_a_windows_stops_growing(exported, kjv_data,
                                                                                              tmp_path):
    ids = AutoTokenizer.from_pretrained(exported["mamba2"])(TEXTS[1], return_tensors="pt")["input_ids"]
    for arch in ("mamba2", "gated_deltanet", "mesa", "mlstm", "hawk"):
        sizes = cache_sizes_while_generating(AutoModelForCausalLM.from_pretrained(exported[arch]), ids, 24)
        assert len(sizes) == 24 and len(set(sizes)) == 1, (arch, sizes)
    sizes = cache_sizes_while_generating(AutoModelForCausalLM.from_pretrained(exported["attention"]), ids, 24)
    per_token = 2 * 2 * 2 * 16 * 4  # layers x (k, v) x heads x head_dim x float32 bytes
    assert [b - a for a, b in zip(sizes, sizes[1:])] == [per_token] * 23
    window = export_tiny(tiny_config("swa", mixer_options={"swa": {"window": 8}}), tmp_path / "swa",
                         Path(kjv_data) / "tokenizer.json")
    sizes = cache_sizes_while_generating(AutoModelForCausalLM.from_pretrained(window), ids, 24)
    assert sizes[-1] == sizes[-2] == sizes[-10] < sizes[0] + 24 * per_token


def test_sampling_and_beam_search_run_and_return_the_cache(exported):
    model = AutoModelForCausalLM.from_pretrained(exported["hawk_mesa"])
    ids = AutoTokenizer.from_pretrained(exported["hawk_mesa"])(TEXTS[1], return_tensors="pt")["input_ids"]
    torch.manual_seed(0)
    sampled = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=True, top_k=20,
                             return_dict_in_generate=True)
    assert sampled.sequences.shape == (1, ids.shape[1] + 6) and isinstance(sampled.cache, LMCache)
    assert sampled.cache.get_seq_length() == ids.shape[1] + 5  # the last token is returned, not yet fed
    beams = model.generate(ids, max_new_tokens=6, min_new_tokens=6, num_beams=3, num_return_sequences=2)
    assert beams.shape == (2, ids.shape[1] + 6)


def test_a_model_made_from_the_config_has_languagemodels_initialisation(exported):
    from transformers import AutoConfig

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(exported["mesa"]))
    torch.manual_seed(0)
    reference = LanguageModel(tiny_config("mesa"))
    for (name, ours), theirs in zip(model.model.state_dict().items(), reference.state_dict().values()):
        assert ours.std().item() == pytest.approx(theirs.std().item(), rel=0.5, abs=1e-6), name


def test_lm_generate_reads_the_hf_directory_and_bad_ones_are_one_line(exported, tmp_path, capsys):
    from lm.cli import main

    generate = ["generate", "--prompt", TEXTS[1], "--max_new_tokens", "20", "--temperature", "0", "--checkpoint"]
    assert main([*generate, str(exported["attention"])]) == 0
    # `lm generate` at temperature 0 writes the text that HF's greedy generate() decodes to.
    model = AutoModelForCausalLM.from_pretrained(exported["attention"])
    tokenizer = AutoTokenizer.from_pretrained(exported["attention"])
    out = model.generate(**tokenizer(TEXTS[1], return_tensors="pt"), max_new_tokens=20, do_sample=False)
    assert capsys.readouterr().out.strip() == tokenizer.decode(out[0], skip_special_tokens=True).strip()
    expected_text = {"missing": "model.safetensors not found", "other type": "holds a 'llama' model, not an lm model",
                     "shape": "cannot load", "damaged": "cannot load"}
    for case, expected in expected_text.items():
        broken = shutil.copytree(exported["attention"], tmp_path / case.replace(" ", "-"))
        config = json.loads((broken / "config.json").read_text())
        if case == "missing":
            (broken / "model.safetensors").unlink()
        elif case == "other type":
            config["model_type"] = "llama"
        elif case == "shape":
            config["lm"]["d_model"] = 48
        else:
            weights = (broken / "model.safetensors").read_bytes()
            (broken / "model.safetensors").write_bytes(weights[:len(weights) // 2])
        (broken / "config.json").write_text(json.dumps(config))
        code, lines = main([*generate, str(broken)]), capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and expected in lines[0], (case, lines)


@pytest.mark.parametrize("mask", [0o022, 0o077], ids=["umask-022", "umask-077"])
def test_exported_files_take_the_users_umask(originals, kjv_data, tmp_path, mask):
    """safetensors writes model.safetensors through a temporary file of mode 0600: every file of both export formats
    (and a result JSON of lm.util.output) has the mode that open() gives under the user's umask, 0644 under 022 and 0600
    (not wider) under 077."""
    from lm.export import save_pretrained
    from lm.util.output import write_json

    model, tokenizer = originals["attention"], Path(kjv_data) / "tokenizer.json"
    previous = os.umask(mask)
    try:
        save_hf(model.state_dict(), model.cfg, tmp_path / "hf", tokenizer)
        save_pretrained(model.state_dict(), model.cfg, tmp_path / "lm", tokenizer)
        write_json(tmp_path / "result.json", {"ppl": 1.0})
    finally:
        os.umask(previous)
    modes = {path.relative_to(tmp_path).as_posix(): oct(path.stat().st_mode & 0o777)
             for path in tmp_path.rglob("*") if path.is_file()}
    assert {"hf/model.safetensors", "lm/model.safetensors", "hf/config.json", "result.json"} <= set(modes)
    assert modes == dict.fromkeys(modes, oct({0o022: 0o644, 0o077: 0o600}[mask]))


def test_bench_hf_generate_reports_a_flat_recurrent_cache_and_a_growing_kv_cache(tmp_path):
    from lm.bench.hf_generate import bench_hf_generate

    result = bench_hf_generate(mixers=["attention", "deltanet"], prompt=4, tokens=5, d_model=32, n_layers=1,
                               n_heads=2, head_dim=16, vocab_size=64, repeats=1, json_out=str(tmp_path / "b.json"))
    rows = {row["mixer"]: row for row in result["rows"]}
    assert rows["attention"]["bytes_per_generated_token"] == 2 * 2 * 16 * 4  # (k, v) x heads x head_dim x float32
    assert rows["deltanet"]["bytes_per_generated_token"] == 0
    assert all(row["same_tokens"] and row["hf_over_lm_time"] > 0 for row in rows.values())
    assert json.loads((tmp_path / "b.json").read_text())["rows"] == result["rows"]
