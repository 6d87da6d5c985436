"""`lm export --format hf`: a Hugging Face directory of an lm model, which `AutoModelForCausalLM.from_pretrained`,
`AutoTokenizer.from_pretrained` and `LanguageModel.from_pretrained` all load.

It holds model.safetensors (LanguageModel's tensors under "model.", float32), config.json (model_type "lm", the
LMConfig under "lm"), generation_config.json, and the tokenizer files. The tokenizer prepends the document separator
to every text, as `lm` does in training, evaluation and generation, and the separator is also bos, eos and pad.
"""

from dataclasses import asdict
from pathlib import Path

from safetensors.torch import save_file
from tokenizers import Tokenizer, processors
from transformers import GenerationConfig, PreTrainedTokenizerFast

from lm.data_prep.tokenizer import separator
from lm.hf.config import LMHFConfig
from lm.model import LMConfig
from lm.util.output import user_mode

WEIGHTS, PREFIX = "model.safetensors", "model."  # LMForCausalLM holds the LanguageModel as .model


def hf_tokenizer(tokenizer_file: str | Path, max_length: int) -> PreTrainedTokenizerFast:
    """The run's tokenizer, with the separator put before every text (add_special_tokens, the default)."""
    tok = Tokenizer.from_file(str(tokenizer_file))
    sep, sep_id = separator(tok)
    tok.post_processor = processors.TemplateProcessing(single=f"{sep} $A", pair=f"{sep} $A {sep} $B",
                                                       special_tokens=[(sep, sep_id)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=sep, eos_token=sep, pad_token=sep,
                                   model_max_length=max_length)


def save_hf(state_dict: dict, config: LMConfig, out: str | Path, tokenizer_file: str | Path | None,
            metadata: dict[str, str] | None = None) -> Path:
    """The directory (without tokenizer files or special token ids when tokenizer_file is None); `metadata` goes
    into the weights' header (`lm export` records its source there)."""
    out = Path(out)
    tokenizer = hf_tokenizer(tokenizer_file, config.max_seq_len) if tokenizer_file is not None else None
    sep = tokenizer.bos_token_id if tokenizer is not None else None
    out.mkdir(parents=True, exist_ok=True)
    save_file({PREFIX + k: v.detach().cpu().float().contiguous().clone() for k, v in state_dict.items()},
              str(out / WEIGHTS), metadata=metadata or {"format": "pt"})
    user_mode(out / WEIGHTS)
    LMHFConfig(lm=asdict(config), vocab_size=config.vocab_size, hidden_size=config.d_model,
               num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
               max_position_embeddings=config.max_seq_len, bos_token_id=sep, eos_token_id=sep, pad_token_id=sep,
               architectures=["LMForCausalLM"]).save_pretrained(out)
    GenerationConfig(bos_token_id=sep, eos_token_id=sep, pad_token_id=sep).save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out
