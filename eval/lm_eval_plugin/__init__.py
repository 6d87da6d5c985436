"""Makes lm-eval's own CLI find the model `lm` (`lm_eval --model lm --model_args checkpoint=DIR`).

lm-eval fills its model registry from a fixed table and reads no entry points, so installing `lm` adds a .pth file
(`lm_eval_model_lm.pth`, see hatch_build.py) that imports this module at interpreter start. It only adds a finder:
nothing of lm-eval or torch is imported until lm-eval itself is. When `lm_eval.api.registry` is imported, lm-eval's
own models are registered first (its get_model loads them only while the registry is empty) and then `lm`, lazily,
as "eval.harness:LMHarness".
"""

import sys

REGISTRY_MODULE = "lm_eval.api.registry"
TARGET = "eval.harness:LMHarness"


def register(registry_module) -> None:
    import lm_eval.models  # noqa: F401  (registers lm-eval's own models)

    if "lm" not in registry_module.model_registry:
        registry_module.model_registry.register("lm", target=TARGET)


class RegisterOnImport:
    """A sys.meta_path finder that finds nothing itself; it wraps the loader of lm-eval's registry so that
    `register` runs right after it. (Not an importlib.abc subclass: importing that would cost every start.)"""

    def find_spec(self, name, path, target=None):
        if name != REGISTRY_MODULE:
            return None
        import importlib.util

        sys.meta_path.remove(self)  # once is enough, and find_spec below must not find us again
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
    if REGISTRY_MODULE in sys.modules:
        register(sys.modules[REGISTRY_MODULE])
    elif not any(isinstance(finder, RegisterOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, RegisterOnImport())
