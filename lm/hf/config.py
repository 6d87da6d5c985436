"""The transformers config of an lm model: the whole LMConfig under "lm", and the few standard fields that tools
built on transformers read (vocabulary, width, depth, heads, longest sequence, special token ids). It imports nothing
of lm, so that registering it with AutoConfig costs nothing."""

from transformers import PreTrainedConfig

MODEL_TYPE = "lm"


class LMHFConfig(PreTrainedConfig):
    """Args (besides PreTrainedConfig's):
        lm: The LMConfig as a dict (dataclasses.asdict); the model is built from it alone.
        vocab_size, hidden_size, num_hidden_layers, num_attention_heads, max_position_embeddings: Copies of LMConfig's
            vocab_size, d_model, n_layers, n_heads and max_seq_len, for tools that look for them (lm-eval's `hf`
            model takes its max_length from max_position_embeddings).
        tie_word_embeddings: False: LanguageModel ties its head to the embedding itself (the head is not a
            separate tensor), so there is nothing for transformers to tie.
    """

    model_type = MODEL_TYPE

    lm: dict | None = None
    vocab_size: int = 50304
    hidden_size: int = 768
    num_hidden_layers: int = 14
    num_attention_heads: int = 6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    use_cache: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
