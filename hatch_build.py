"""Build hook: the wheel (editable or not) puts lm/lm_startup.pth into site-packages, so that `lm_eval --model lm`
and transformers' AutoModelForCausalLM find lm's models once `lm` is installed (see lm/startup.py)."""

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

PTH = "lm/lm_startup.pth"


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version, build_data):
        key = "force_include_editable" if version == "editable" else "force_include"
        build_data[key][PTH] = "lm_startup.pth"
