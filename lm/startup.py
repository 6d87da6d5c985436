"""What installing `lm` registers at interpreter start, so that other tools find lm models without importing lm:

- lm-eval's model `lm` (`lm_eval --model lm --model_args checkpoint=DIR`), as "lm.eval.harness:LMHarness";
- transformers' `AutoConfig` and `AutoModelForCausalLM` for model_type "lm" (the directories `lm export --format hf`
  writes), so that `AutoModelForCausalLM.from_pretrained(DIR)` and lm-eval's `hf` model load them.

And one setting, for the same processes: DeepSpeed's log goes to stderr rather than stdout, where its notice at import
("Setting accelerator to CPU") would mix with what `lm eval ppl`, `lm export`, `lm generate` or `lm_eval --model lm`
print as their result (stdout carries only that).

Neither library reads entry points for this, so installing `lm` adds a .pth file (`lm_startup.pth`, see
hatch_build.py) that calls `install()` at interpreter start. It only adds an import finder: nothing of lm-eval,
transformers, DeepSpeed or torch is imported until the library itself is. When one of the modules below is first
imported, the finder runs its registration right after it. lm-eval's own models are registered first (its get_model
loads them only while the registry is empty).
"""

import sys


def register_lm_eval_model(registry_module) -> None:
    import lm_eval.models  # noqa: F401  (registers lm-eval's own models)

    if "lm" not in registry_module.model_registry:
        registry_module.model_registry.register("lm", target="lm.eval.harness:LMHarness")


def register_hf_config(configuration_auto) -> None:
    from lm.hf.config import MODEL_TYPE, LMHFConfig

    configuration_auto.AutoConfig.register(MODEL_TYPE, LMHFConfig, exist_ok=True)


def register_hf_model(modeling_auto) -> None:
    """LMForCausalLM under model_type "lm", as transformers lists its own models: by name, in the mapping's names, with
    the module that holds it. That module (lm.hf.auto_model) imports lm.hf.model only when the class is first asked
    for: importing transformers' Auto classes happens in every Lightning process (torchmetrics imports them), and
    lm.hf.model with it would cost each one seconds."""
    import importlib

    from lm.hf.config import MODEL_TYPE, LMHFConfig

    mapping = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING
    modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[MODEL_TYPE] = "LMForCausalLM"
    mapping._reverse_config_mapping[LMHFConfig.__name__] = MODEL_TYPE
    mapping._modules[MODEL_TYPE] = importlib.import_module("lm.hf.auto_model")


def deepspeed_log_to_stderr(logging_module) -> None:
    """DeepSpeed's logger ("DeepSpeed") writes through its own handler to stdout, and logs at import: the handler
    writes to stderr instead (where Python's logging writes by default), and its notice on every CPU-only machine
    ("Setting accelerator to CPU") is dropped, as `lm train` drops it (lm.training.console), so that a command's
    one-line error stays one line."""
    import logging

    from lm.training.console import BANNERS, DropMessages

    logger = logging.getLogger("DeepSpeed")
    for handler in logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    if not any(isinstance(f, DropMessages) for f in logger.filters):
        logger.addFilter(DropMessages(BANNERS["DeepSpeed"]))


# module name -> what to register once it has been imported
HOOKS = {
    "lm_eval.api.registry": register_lm_eval_model,
    "transformers.models.auto.configuration_auto": register_hf_config,
    "transformers.models.auto.modeling_auto": register_hf_model,
    "deepspeed.utils.logging": deepspeed_log_to_stderr,  # before deepspeed's __init__ gets to its first notice
}


class RegisterOnImport:
    """A sys.meta_path finder that finds nothing itself; it wraps the loader of each module in HOOKS so that its
    registration runs right after it. (Not an importlib.abc subclass: importing that would cost every start.)"""

    def __init__(self):
        self.pending = dict(HOOKS)

    def find_spec(self, name, path, target=None):
        if name not in self.pending:
            return None
        register = self.pending.pop(name)  # once is enough, and find_spec below must not find us again
        if not self.pending:
            sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            register(module)

        spec.loader.exec_module = exec_then_register
        return spec


def install() -> None:
    finder = RegisterOnImport()
    for name in list(finder.pending):
        if name in sys.modules:  # imported before us (a .pth file that sorts earlier)
            finder.pending.pop(name)(sys.modules[name])
    if finder.pending and not any(isinstance(f, RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, finder)
