"""lm models in Hugging Face transformers' format: `lm export --format hf` writes a directory that
`AutoModelForCausalLM.from_pretrained` loads (lm/startup.py registers the classes when `lm` is installed).

- config.py: the config (model_type "lm"), which carries the LMConfig whole;
- model.py: `LMForCausalLM`, a PreTrainedModel that wraps `LanguageModel` (no second implementation of any mixer);
- cache.py: `LMCache`, the transformers Cache that carries every layer's mixer state through `generate()`;
- export.py: writing the directory (weights, config, generation config, tokenizer).
"""
