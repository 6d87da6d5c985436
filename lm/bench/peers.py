"""lm against its peers, measured in one process with the two sides taking turns, so that a noisy (shared) machine
slows both alike and the ratios mean more than either figure alone.

GPT: lm's attention LanguageModel vs litgpt's GPT built to the same architecture (`litgpt_config`): pre-RMSNorm
blocks with the same eps, sequential residuals, multi-head (or grouped-query) attention with full-width RoPE
(the same half-split rotation and base), no biases, a SwiGLU MLP ("LLaMAMLP") of the same width, a final RMSNorm, a
tanh logit soft cap, and tied embeddings. litgpt's Config has no tying option; its pretrain script ties by sharing
the embedding with the head (`wte.weight = lm_head.weight`), and so does this benchmark. lm's weights are copied into
the litgpt model, whose logits are then checked against lm's: the two compute the same function, and both train from
the same weights on the same tokens. What still differs is how, not what (`GPT_DIFFERENCES`).

mLSTM: lm.ops.mlstm (the torch chunkwise code) vs mlstm_kernels' native chunkwise mLSTM
(`mlstm_chunkwise__native_autograd`, plain PyTorch with autograd) on the inputs and head shapes lm's mlstm mixer
feeds its op (lm.bench.mixer_speed.op_inputs), in float32 with the mixer's chunk size. The two compute the same mLSTM:
both take the forget gate pre-activation (and apply logsigmoid), the input gate pre-activation as a log-weight, scale
q by K^-1/2, start from the zero state with m = 0, and divide by max(|n~ . q^|, exp(-m)) + eps with the same eps.
So the inputs are the same tensors, moved from lm's [B, T, H, *] layout to the peer's [B, H, T, *] before timing.
The native code needs T to be a multiple of the chunk size; for other T its inputs are zero-padded at the end inside
the timed call (lm pads internally too) and the output cut back, which changes nothing before T (causality).
What can still differ is rounding: lm sums log forget gates per segment where the peer subtracts cumulative sums,
and lm detaches the stabiliser m from autograd where the peer differentiates through it (exact for eps = 0, O(eps)
otherwise). The reported max abs differences of outputs and input gradients show how small that is.

Mesa: lm.ops.mesa vs flash-linear-attention's chunk_mesa_net (lm/bench/mesa_peer.py), at equal CG steps, each with its
error against the float64 solve.
"""

import importlib.metadata
from functools import partial

import torch
import torch.nn.functional as F

from lm.accounting.flops import train_flops_per_token
from lm.bench.mesa_peer import bench_mesa, print_mesa_table
from lm.bench.mixer_speed import forward_backward, op_inputs
from lm.bench.progress import each_run
from lm.bench.results import print_and_save
from lm.bench.timing import best_interleaved
from lm.bench.train_speed import device_name
from lm.mixers import MLSTM
from lm.model import LanguageModel, LMConfig
from lm.ops import mlstm
from lm.training.module import next_token_loss
from lm.util.errors import UserError

PEERS_INSTALL = 'pip install --no-deps "litgpt==0.5.13" "mlstm_kernels==2.0.6" einops'

GPT_DIFFERENCES = [
    "litgpt projects q, k, v with one fused Linear (one matmul); lm uses three",
    "litgpt caches RoPE cos/sin as buffers; lm computes them in every attention call",
    "litgpt's RMSNorm is Python code that upcasts to float32; lm uses torch.nn.RMSNorm",
    "init differs in each library, but lm's weights are copied into the litgpt model here",
]


PEERS = ("litgpt", "mlstm_kernels", "fla")  # GPT, mLSTM and Mesa


def import_peers():
    """litgpt's GPT and Config and mlstm_kernels' native chunkwise mLSTM; a UserError naming the install if missing."""
    try:
        from litgpt.config import Config
        from litgpt.model import GPT
        from mlstm_kernels.torch.chunkwise.native import mlstm_chunkwise__native_autograd
    except ImportError as err:
        raise UserError(f"bench peers needs litgpt and mlstm_kernels ({err}); install them with: "
                        f"{PEERS_INSTALL}") from None
    return GPT, Config, mlstm_chunkwise__native_autograd


def litgpt_config(Config, model: LanguageModel):
    """A litgpt Config for the architecture of lm's attention model, read off the model so the two cannot drift."""
    cfg, attn = model.cfg, model.blocks[0].mixer
    return Config(
        name="lm-peer", block_size=cfg.max_seq_len, n_layer=cfg.n_layers, n_embd=cfg.d_model,
        vocab_size=cfg.vocab_size, padded_vocab_size=cfg.vocab_size,  # no padding of the vocabulary
        n_head=attn.n_heads, head_size=attn.head_dim, n_query_groups=attn.n_kv_heads,
        norm_class_name="RMSNorm", norm_eps=cfg.norm_eps, parallel_residual=False, bias=False,
        rotary_percentage=1.0, rope_base=attn.rope_theta, mlp_class_name="LLaMAMLP",
        intermediate_size=cfg.mlp_hidden, final_logit_softcapping=cfg.logit_soft_cap,
    )  # fmt: skip


def litgpt_twin(GPT, Config, model: LanguageModel):
    """litgpt's GPT with lm's architecture and lm's weights (tied embeddings, as litgpt's pretrain ties them)."""
    gpt = GPT(litgpt_config(Config, model)).to(next(model.parameters()).device)
    if model.cfg.tie_embeddings:
        gpt.transformer.wte.weight = gpt.lm_head.weight
    state = {"transformer.wte.weight": model.embed.weight, "transformer.ln_f.weight": model.norm.weight,
             "lm_head.weight": model.embed.weight if model.head is None else model.head.weight}
    for i, block in enumerate(model.blocks):
        a, mlp, h = block.mixer, block.mlp, f"transformer.h.{i}."
        state |= {h + "norm_1.weight": block.mixer_norm.weight, h + "norm_2.weight": block.mlp_norm.weight,
                  h + "attn.qkv.weight": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                  h + "attn.proj.weight": a.out_proj.weight, h + "mlp.fc_1.weight": mlp.gate_proj.weight,
                  h + "mlp.fc_2.weight": mlp.up_proj.weight, h + "mlp.proj.weight": mlp.down_proj.weight}
    gpt.load_state_dict({k: v.detach() for k, v in state.items()})  # strict: every parameter has its lm twin
    return gpt


def bench_gpt(GPT, Config, d_model, n_layers, n_heads, head_dim, vocab_size, seq_len, batch, steps, warmup, repeats,
              device) -> dict:
    """Training tokens/s of lm's attention model and its litgpt twin, in alternating blocks of `steps` steps."""
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads, head_dim=head_dim,
                   mixer="attention", max_seq_len=seq_len)
    model = LanguageModel(cfg).to(device)
    gpt = litgpt_twin(GPT, Config, model)
    windows = torch.randint(0, vocab_size, (batch, seq_len + 1), device=device)
    with torch.no_grad():  # the same function: same logits from the same weights (fp32)
        logits_diff = (model(windows[:, :-1])[0] - gpt(windows[:, :-1])).abs().max().item()

    def litgpt_loss(net, windows):  # next_token_loss for a model that returns the logits alone
        return F.cross_entropy(net(windows[:, :-1]).float().flatten(0, 1), windows[:, 1:].flatten())

    def training(net, loss_fn):
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)

        def run_steps(n=steps):
            for _ in range(n):
                # bf16 autocast on CUDA, fp32 on CPU, as bench train does.
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                    loss = loss_fn(net, windows)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        return run_steps

    calls = {"lm": training(model, next_token_loss), "litgpt": training(gpt, litgpt_loss)}
    for run_steps in calls.values():
        run_steps(warmup)
    seconds = best_interleaved(calls, repeats, device)
    tokens_per_s = {name: batch * seq_len * steps / s for name, s in seconds.items()}
    return {
        "d_model": d_model, "n_layers": n_layers, "n_heads": n_heads, "head_dim": head_dim, "vocab_size": vocab_size,
        "seq_len": seq_len, "batch": batch, "steps": steps, "repeats": repeats,
        "params_lm": model.num_params(), "params_litgpt": sum(p.numel() for p in gpt.parameters()),
        "logits_max_abs_diff": logits_diff, "differences": GPT_DIFFERENCES,
        "flops_per_token": train_flops_per_token(cfg, seq_len),
        "tokens_per_s_lm": tokens_per_s["lm"], "tokens_per_s_litgpt": tokens_per_s["litgpt"],
        "lm_vs_litgpt": tokens_per_s["lm"] / tokens_per_s["litgpt"],
    }  # fmt: skip


def heads_first(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H, *] -> [B, H, T, *], contiguous and detached."""
    return x.detach().transpose(1, 2).contiguous()


def lm_mlstm(q, k, v, i_pre, f_pre, eps: float, chunk_size: int) -> tuple:
    """lm's chunkwise mLSTM (the torch code, whatever the device and dtype): (output, final state), inputs
    [B, T, H, *]."""
    return mlstm(q, k, v, i_pre, f_pre, eps=eps, chunk_size=chunk_size, backend="torch")


def native_mlstm(native, q, k, v, i_pre, f_pre, eps: float, chunk_size: int) -> tuple:
    """mlstm_kernels' native chunkwise mLSTM: (output,), inputs [B, H, T, *]. It needs whole chunks: a ragged T is
    zero-padded at the end and the output cut back, which leaves the outputs before T as they are (causality)."""
    T, pad = q.shape[2], -q.shape[2] % chunk_size
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        i_pre, f_pre = F.pad(i_pre, (0, pad)), F.pad(f_pre, (0, pad))
    return (native(q, k, v, i_pre, f_pre, eps=eps, chunk_size=chunk_size)[:, :, :T],)


def compare_mlstm(native, args: list[torch.Tensor], proj: torch.Tensor, eps: float, chunk_size: int) -> tuple:
    """Both mLSTMs on the same inputs (lm's layout [B, T, H, *]), forward + backward once: (lm call, peer call,
    max abs difference of the outputs, of the input gradients). The calls rerun the same work, for timing."""
    lm_args = [a.detach().requires_grad_() for a in args]
    peer_args = [heads_first(a).requires_grad_() for a in args]  # the same tensors in the peer's layout
    lm_call = partial(forward_backward, partial(lm_mlstm, eps=eps, chunk_size=chunk_size), lm_args, proj)
    peer_call = partial(forward_backward, partial(native_mlstm, native, eps=eps, chunk_size=chunk_size), peer_args,
                        heads_first(proj))
    out_diff = (lm_call() - peer_call().transpose(1, 2)).abs().max().item()
    grad_diff = max((a.grad - b.grad.transpose(1, 2)).abs().max().item() for a, b in zip(lm_args, peer_args))
    return lm_call, peer_call, out_diff, grad_diff


def bench_mlstm(native, lengths, d_model, n_heads, batch, repeats, device) -> dict:
    """Forward + backward ms of lm.ops.mlstm and mlstm_kernels' native chunkwise mLSTM at each length, float32, on
    the inputs lm's mlstm mixer feeds its op, after measuring how far their outputs and input gradients differ."""
    mixer = MLSTM(d_model, n_heads)
    rows = []
    for T in lengths:
        _, args, proj = op_inputs(MLSTM.name, T, d_model, n_heads, 0, batch)
        lm_call, peer_call, out_diff, grad_diff = compare_mlstm(
            native, [a.to(device) for a in args], proj.to(device), mixer.eps, mixer.chunk_size)  # also a warm-up
        seconds = best_interleaved({"lm": lm_call, "native": peer_call}, repeats, device)
        rows.append({"T": T, "lm_ms": 1e3 * seconds["lm"], "native_ms": 1e3 * seconds["native"],
                     "lm_vs_native": seconds["native"] / seconds["lm"],
                     "out_max_abs_diff": out_diff, "grad_max_abs_diff": grad_diff})
    return {"d_model": d_model, "n_heads": n_heads, "K": mixer.qk_head, "V": mixer.v_head, "batch": batch,
            "chunk_size": mixer.chunk_size, "eps": mixer.eps, "dtype": "float32", "repeats": repeats, "rows": rows}


def bench_peers(d_model: int = 512, n_layers: int = 4, n_heads: int = 8, head_dim: int = 64, vocab_size: int = 8192,
                seq_len: int = 256, batch: int = 8, steps: int = 2, warmup: int = 1,
                mlstm_lengths: list[int] = [512, 2048, 8192], mlstm_batch: int = 1,  # noqa: B006
                mesa_lengths: list[int] = [2048], mesa_heads: int = 12, mesa_head_dim: int = 128,  # noqa: B006
                mesa_batch: int = 1, cg_steps: int = 30, mesa_backend: str = "auto", peers: list[str] = list(PEERS),  # noqa: B006
                repeats: int = 3, threads: int | None = None, json_out: str | None = None) -> dict:
    """lm vs litgpt's GPT (training steps), mlstm_kernels' native mLSTM and fla's chunk_mesa_net (forward + backward),
    as ratios in one run.

    Speed ratios (lm_vs_litgpt, lm_vs_native, lm_vs_fla) are lm's speed over the peer's: above 1, lm is faster.

    Args:
        d_model: Width of the residual stream (both GPTs) and of the mLSTM mixer whose head shapes the op gets.
        n_layers: Blocks of both GPTs.
        n_heads: Attention heads of both GPTs, and heads of the mLSTM.
        head_dim: Attention head size of both GPTs (the mLSTM's follow d_model: K = d_model / 2 / n_heads,
            V = d_model / n_heads, as in xLSTM 7B).
        vocab_size: Vocabulary of both GPTs (litgpt's padded_vocab_size is set to it: no padding).
        seq_len: Tokens per training sequence.
        batch: Sequences per training step.
        steps: Training steps per timed block; each model runs `repeats` blocks, taking turns with the other.
        warmup: Untimed training steps of each model first.
        mlstm_lengths: Sequence lengths T of the mLSTM comparison.
        mlstm_batch: Sequences per mLSTM call.
        mesa_lengths: Sequence lengths T of the Mesa comparison (fla's runs on CUDA only).
        mesa_heads: Heads of the Mesa comparison (default: the 1B config's 12).
        mesa_head_dim: K = V of the Mesa comparison (default: the 1B config's 128, fla's largest).
        mesa_batch: Sequences per Mesa call.
        cg_steps: CG steps of both Mesa ops.
        mesa_backend: lm's Mesa backend ("auto": the Triton kernels on CUDA; "triton" on the CPU with
            TRITON_INTERPRET=1 measures the kernels' error there, their time meaning nothing).
        peers: Which peers to run, of litgpt (GPT), mlstm_kernels (mLSTM) and fla (Mesa; the Mesa comparison alone
            needs neither litgpt nor mlstm_kernels, and measures lm's error where fla cannot run).
        repeats: Timed rounds (GPT blocks, mLSTM calls); the best of each side counts.
        threads: CPU threads for torch (torch.set_num_threads); None keeps torch's default.
        json_out: Also write the result as JSON to this path.
    """
    if min(steps, batch, seq_len, repeats, mlstm_batch, mesa_batch, mesa_heads, mesa_head_dim, cg_steps) < 1 \
            or warmup < 0 or min(mlstm_lengths, default=0) < 1 or min(mesa_lengths, default=0) < 1:
        raise UserError(f"need steps, batch, seq_len, repeats, mlstm_batch, mesa_batch, mesa_heads, mesa_head_dim, "
                        f"cg_steps >= 1, warmup >= 0 and mlstm_lengths, mesa_lengths (at least one each) >= 1; got "
                        f"{steps}, {batch}, {seq_len}, {repeats}, {mlstm_batch}, {mesa_batch}, {mesa_heads}, "
                        f"{mesa_head_dim}, {cg_steps}, {warmup}, {mlstm_lengths}, {mesa_lengths}")
    if not peers or set(peers) - set(PEERS):
        raise UserError(f"peers must be some of {list(PEERS)}, got {peers}")
    if {"litgpt", "mlstm_kernels"} & set(peers):
        GPT, Config, native = import_peers()
    if threads is not None:
        torch.set_num_threads(threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"device": device_name(device), "torch": torch.__version__, "threads": torch.get_num_threads()}
    for peer in each_run([p for p in PEERS if p in peers], "lm bench peers"):
        if peer == "litgpt":
            result["litgpt"] = importlib.metadata.version("litgpt")
            result["gpt"] = bench_gpt(GPT, Config, d_model, n_layers, n_heads, head_dim, vocab_size, seq_len, batch,
                                      steps, warmup, repeats, device)
        elif peer == "mlstm_kernels":
            result["mlstm_kernels"] = importlib.metadata.version("mlstm_kernels")
            result["mlstm_op"] = bench_mlstm(native, mlstm_lengths, d_model, n_heads, mlstm_batch, repeats, device)
        else:
            result["mesa_op"] = bench_mesa(mesa_lengths, mesa_heads, mesa_head_dim, mesa_batch, cg_steps, repeats,
                                           device, mesa_backend)

    print_and_save(result, json_out)
    if "litgpt" in peers:
        print_gpt_table(result, d_model, n_layers, seq_len, batch)
    if "mlstm_kernels" in peers:
        print_mlstm_table(result["mlstm_op"], n_heads)
    if "fla" in peers:
        print_mesa_table(result["mesa_op"])
    return result


def print_gpt_table(result: dict, d_model: int, n_layers: int, seq_len: int, batch: int) -> None:
    g = result["gpt"]
    print(f"\nGPT training step ({result['device']}, {g['params_lm'] / 1e6:.2f}M params each, "
          f"{g['flops_per_token'] / 1e6:.1f} MFLOP/token, logits agree to {g['logits_max_abs_diff']:.1e})\n")
    print("| d_model | n_layers | seq_len | batch | lm tokens/s | litgpt tokens/s | lm / litgpt |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {d_model} | {n_layers} | {seq_len} | {batch} | {g['tokens_per_s_lm']:,.0f} "
          f"| {g['tokens_per_s_litgpt']:,.0f} | {g['lm_vs_litgpt']:.2f} |")


def print_mlstm_table(m: dict, n_heads: int) -> None:
    print(f"\nmLSTM forward + backward (float32, H {n_heads}, K {m['K']}, V {m['V']}, chunk {m['chunk_size']})\n")
    print("| T | lm ms | native ms | lm speed / native | max abs diff out | max abs diff grads |")
    print("|---|---|---|---|---|---|")
    for r in m["rows"]:
        print(f"| {r['T']} | {r['lm_ms']:.1f} | {r['native_ms']:.1f} | {r['lm_vs_native']:.2f} "
              f"| {r['out_max_abs_diff']:.1e} | {r['grad_max_abs_diff']:.1e} |")
