"""Build hook: the wheel (editable or not) puts eval/lm_eval_plugin's .pth file into site-packages, so that
`lm_eval --model lm` finds lm's model once `lm` is installed (see eval/lm_eval_plugin/__init__.py)."""

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

PTH = "eval/lm_eval_plugin/lm_eval_model_lm.pth"


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version, build_data):
        key = "force_include_editable" if version == "editable" else "force_include"
        build_data[key][PTH] = "lm_eval_model_lm.pth"
