"""lm-evaluation-harness adapter: an `lm_eval` LM registered as `lm`.

    lm_eval.simple_evaluate(model="lm", model_args="checkpoint=runs/x,batch_size=4", tasks=[...])

Every sequence starts with the tokenizer's document separator, as in training. Batches are padded on the right
only: every mixer is causal, so a real token's logits never see the padding behind it, and a recurrent state is
never fed a pad before real tokens. A batch of 4 scores what 4 batches of 1 score.
"""

import sys

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tokenizers import Tokenizer

from lm.data_prep.tokenizer import separator
from lm.training.checkpoint import load_with_tokenizer
from lm.util.errors import UserError

# What lm_eval's command line passes when --device is not given (lm_eval.config.evaluate_config.EvaluatorConfig).
LM_EVAL_CLI_DEFAULT_DEVICE = "cuda:0"


def resolve_device(device: str | None, model=None) -> torch.device:
    """The device to evaluate on. Without one: a model object's own, else CUDA where there is CUDA, else the CPU.
    lm_eval's command line passes "cuda:0" when --device is not given, so on a machine without CUDA that value is
    taken as no device (as lm_eval's own `hf` model does) rather than failing with "Torch not compiled with CUDA"."""
    if device == LM_EVAL_CLI_DEFAULT_DEVICE and not torch.cuda.is_available():
        print(f"lm: no CUDA on this machine: evaluating on the CPU, not on {device}", file=sys.stderr)
        device = None
    if device is not None:
        return torch.device(device)
    if model is not None:
        return next(model.parameters()).device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@register_model("lm")
class LMHarness(LM):
    """An lm model for lm-eval: loglikelihood, loglikelihood_rolling and generate_until.

    Args:
        checkpoint: A checkpoint, a run directory (its newest checkpoint) or an `lm export` directory.
        batch_size: Sequences per forward pass (lm-eval's "auto" means 1).
        device: Torch device (default: the model object's own; for a checkpoint, "cuda" where CUDA is available,
            else "cpu").
        max_length: Longest sequence fed at once (default: the model's max_seq_len).
        model, tokenizer: Instead of a checkpoint, a LanguageModel and its Tokenizer (the Python API).
    """

    def __init__(self, checkpoint: str | None = None, batch_size: int | str = 1, device: str | None = None,
                 max_length: int | None = None, model=None, tokenizer: Tokenizer | None = None, **_unused):
        super().__init__()
        device = resolve_device(device, model)
        if model is None:
            if checkpoint is None:
                raise UserError("the lm model needs checkpoint=DIR in --model_args")
            model, tokenizer = load_with_tokenizer(checkpoint)
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.sep = separator(tokenizer)[1]
        self._device = device
        self.batch_size = 1 if str(batch_size).startswith("auto") else int(batch_size)
        self.max_length = int(max_length or model.cfg.max_seq_len)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    # --- scoring -------------------------------------------------------------------------------------------

    @torch.no_grad()
    def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether it is the greedy continuation) per (context,
        continuation) token pair. Longest first, batched with right padding; results in the input order."""
        windows = []
        for context, continuation in pairs:
            if not continuation:
                raise ValueError("an empty continuation has no log-likelihood")
            tokens = (context + continuation)[-(self.max_length + 1):]
            windows.append((tokens[:-1], min(len(continuation), len(tokens) - 1)))
        order = sorted(range(len(windows)), key=lambda i: -len(windows[i][0]))
        results: list[tuple[float, bool] | None] = [None] * len(windows)
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            width = len(windows[batch[0]][0])
            inputs = torch.full((len(batch), width), self.sep, dtype=torch.long)
            for row, i in enumerate(batch):
                inputs[row, :len(windows[i][0])] = torch.tensor(windows[i][0])
            logprobs = F.log_softmax(self.model(inputs.to(self._device))[0].float(), dim=-1).cpu()
            for row, i in enumerate(batch):
                length, n = len(windows[i][0]), windows[i][1]
                targets = torch.tensor((pairs[i][0] + pairs[i][1])[-n:])
                rows = logprobs[row, length - n:length]
                results[i] = (float(rows.gather(-1, targets[:, None]).sum()),
                              bool((rows.argmax(dim=-1) == targets).all()))
        return results

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = []
        for request in requests:
            context, continuation = request.args
            # A space that ends the context belongs to the continuation's first token in BPE.
            spaces = len(context) - len(context.rstrip())
            context, continuation = context[:len(context) - spaces], context[len(context) - spaces:] + continuation
            whole = self.encode(context + continuation)
            context_ids = self.encode(context)
            pairs.append(([self.sep] + whole[:len(context_ids)], whole[len(context_ids):]))
        return self.score(pairs)

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Log-likelihood of whole texts. A text longer than max_length is scored in windows that each carry
        the half window before them as context."""
        results = []
        for request in requests:
            tokens = self.encode(request.args[0])
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                tokens, prefix_token=self.sep, max_seq_len=self.max_length, context_len=self.max_length // 2)]
            results.append(sum(ll for ll, _ in self.score(windows)))
        return results

    # --- generation -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate_until(self, requests) -> list[str]:
        """Greedy (or sampled, with do_sample) continuation from the carried state, up to max_gen_toks tokens,
        cut at the first stop string or at the document separator."""
        outputs = []
        for request in requests:
            context, kwargs = request.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", 256))
            temperature = float(kwargs.pop("temperature", 0.0)) if kwargs.pop("do_sample", False) else 0.0
            prompt = ([self.sep] + self.encode(context))[-max(1, self.max_length - max_new):]
            logits, state = self.model(torch.tensor([prompt], device=self._device))
            new: list[int] = []
            text = ""
            for _ in range(max_new):
                last = logits[0, -1].float()
                token = int(last.argmax() if temperature == 0 else
                            torch.multinomial((last / temperature).softmax(-1), 1))
                if token == self.sep:
                    break
                new.append(token)
                text = self.tokenizer.decode(new)
                if any(stop in text for stop in until):
                    break
                logits, state = self.model(torch.tensor([[token]], device=self._device), state)
            for stop in until:
                text = text.split(stop)[0]
            outputs.append(text)
        return outputs
