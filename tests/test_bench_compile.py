"""torch.compile for every mixer: a compiled block computes what the eager one does (output and every gradient), and
`lm bench compile` runs. Both use the "aot_eager_decomp_partition" backend: Dynamo's tracing, AOT autograd with
inductor's decompositions and its forward/backward partition, where graph breaks, untraceable side effects and stride
mistakes show up, without inductor's code generation (a minute or more per mixer on a small CPU). Plain "aot_eager"
fails on Gated DeltaNet's backward (a view of a gradient whose strides differ from the traced ones, in torch 2.13,
with or without this project's changes); inductor and this backend do not."""

import copy
import json

import pytest
import torch

from lm.cli import main
from lm.mixers import MIXERS
from lm.model import Block, LMConfig

BACKEND = "aot_eager_decomp_partition"


@pytest.mark.parametrize("mixer", list(MIXERS))
def test_compiled_block_equals_eager(mixer):
    torch.manual_seed(0)
    # T 80 with chunks of 64: two chunks, the second one padded
    cfg = LMConfig(mixer=mixer, d_model=32, n_layers=1, n_heads=2, head_dim=16, vocab_size=64, max_seq_len=80)
    eager = Block(cfg, 0, mixer)
    compiled = copy.deepcopy(eager)
    compiled.compile(backend=BACKEND)
    x = torch.randn(2, 80, 32)
    results = []
    for block in (eager, compiled):
        xi = x.clone().requires_grad_()
        y, _ = block(xi)
        (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
        results.append([y.detach(), xi.grad] + [p.grad for p in block.parameters()])
    torch._dynamo.reset()
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_bench_compile_command(tmp_path, capsys):
    out = tmp_path / "compile.json"
    rc = main(["bench", "compile", "--mixers", "[deltanet, mesa]", "--d_model", "32", "--head_dim", "16",
               "--seq_len", "24", "--batch", "1", "--vocab_size", "64", "--n_layers", "1", "--repeats", "1",
               "--backend", BACKEND, "--json_out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    result = json.loads(printed[: printed.index("\n\n")])
    assert json.loads(out.read_text()) == result
    rows = {r["mixer"]: r for r in result["rows"]}
    assert all(r["status"] == "ok" and r["eager_ms"] > 0 and r["compiled_ms"] > 0 for r in rows.values())
    assert rows["deltanet"]["graph_breaks"] == 0 and rows["deltanet"]["loss_diff"] < 1e-5
    # Mesa's op is left out of the graph on purpose (lm.ops.mesa._apply_eagerly), and the table names why.
    assert rows["mesa"]["graph_breaks"] > 0 and "mesa.py" in rows["mesa"]["break_reasons"][0]
    assert "| mixer | params | eager ms |" in printed and "- mesa: " in printed
