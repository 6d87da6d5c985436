"""The module transformers' Auto mapping holds for model_type "lm" (lm.startup): LMForCausalLM, imported from
lm.hf.model when it is first asked for."""


def __getattr__(name: str):
    if name == "LMForCausalLM":
        from lm.hf.model import LMForCausalLM

        return LMForCausalLM
    raise AttributeError(name)
