"""`trainer.compile` with inductor, torch.compile's default backend, as `lm train` applies it: LMModule.configure_model
compiles each block; two training steps (next_token_loss, AdamW from configure_optimizers) give eager's losses.
tests/test_bench_compile.py covers every mixer with the cheaper aot_eager_decomp_partition backend; this one runs
inductor's code generation, on attention and one recurrent mixer (Gated DeltaNet), kept tiny for its compile time."""

import torch
import torch._inductor.config

from lm.model import LMConfig
from lm.training.module import LMModule, next_token_loss
from lm.training.schedule import OptimConfig

CFG = LMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, head_dim=16, max_seq_len=32,
               layer_pattern="attention, gated_deltanet")


def two_step_losses(compile: bool) -> list[float]:
    torch.manual_seed(0)
    module = LMModule(CFG, OptimConfig(warmup_steps=1), max_steps=2, compile=compile)
    module.configure_model()  # what Lightning calls: with compile, block.compile() on every block
    assert all((block._compiled_call_impl is not None) == compile for block in module.model.blocks)
    optimizer = module.configure_optimizers()["optimizer"]
    batches = torch.randint(0, CFG.vocab_size, (2, 2, CFG.max_seq_len + 1), generator=torch.Generator().manual_seed(1))
    losses = []
    for batch in batches:
        loss = next_token_loss(module.model, batch)  # LMModule.training_step's loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_inductor_compiled_training_steps_equal_eager():
    # One compile worker (TORCHINDUCTOR_COMPILE_THREADS=1, read when inductor's config is first imported): no pool of
    # subprocesses to start on a small machine. Through the config's own patch: monkeypatch's undo hides a torch config
    # entry for the rest of the process ("compile_threads does not exist" in the next inductor compile).
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        with torch._inductor.config.patch(compile_threads=1):
            eager = two_step_losses(compile=False)
            compiled = two_step_losses(compile=True)
        inductor = dict(torch._dynamo.utils.counters["inductor"])
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert graphs >= 2 and inductor, (graphs, inductor)  # both blocks were traced, and inductor compiled them
    assert len(compiled) == 2 and all(abs(c - e) <= 1e-4 for c, e in zip(compiled, eager, strict=True)), \
        (compiled, eager)
