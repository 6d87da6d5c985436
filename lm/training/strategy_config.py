"""The `strategy` section of a run config (where the run's processes go and how the model is spread over them) and
its checks, apart from the Lightning strategies it becomes (lm.training.strategy): `lm train` checks it before it
imports Lightning (lm.training.preflight). Parsing a run's config imports this without torch (its CUDA questions
import it when asked) and without lm.mixers (context parallelism's layout check, which imports torch, runs where
strategy.context_parallel is not 1), so that a mistake in the config ends in one line before torch's import.
"""

import json
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

from lm.training.extension_lock import wait_for_builds
from lm.util.errors import UserError

NAMES = ("auto", "single", "ddp", "deepspeed", "fsdp")
ACCELERATORS = ("auto", "cpu", "gpu", "cuda")
# Lightning's precisions (lightning.fabric.plugins.precision.precision._PRECISION_INPUT), its aliases as Lightning
# converts them; FSDP2 (Lightning's ModelParallelStrategy) takes only some of them.
PRECISION_ALIASES = {"64": "64-true", "32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true", "64-true", "transformer-engine",
              "transformer-engine-float16", *PRECISION_ALIASES)
FSDP_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")


@dataclass
class StrategyConfig:
    """How the model, gradients and optimizer state are spread over devices.

    Args:
        name: "auto" (one device: single; more: ddp), "single", "ddp", "deepspeed" (ZeRO) or "fsdp" (FSDP2, one
            `fully_shard` per block, through Lightning's ModelParallelStrategy).
        accelerator: "auto", "cpu" or "gpu" ("cuda" is the same).
        devices: Processes (devices) per node, or "auto".
        num_nodes: Nodes.
        precision: Lightning precision (32-true, bf16-mixed, bf16-true, 16-mixed, 16-true, 64-true,
            transformer-engine); None: bf16-mixed on GPU, 32-true on CPU. 16-mixed on the CPU trains in bf16-mixed.
        zero_stage: DeepSpeed ZeRO stage 1, 2 or 3.
        offload_optimizer: DeepSpeed: keep optimizer state (and its step) on the CPU.
        offload_params: DeepSpeed stage 3: keep parameters on the CPU.
        deepspeed_config: A DeepSpeed JSON (see configs/deepspeed/); the settings above override its keys.
        context_parallel: Ranks that share each window (lm.mixers.context_parallel), each holding a contiguous piece of
            data.seq_len / N tokens; the data-parallel size is then the processes / N. DDP or FSDP (which shards over
            every process).
    """

    name: str = "auto"
    accelerator: str = "auto"
    devices: int | str = 1
    num_nodes: int = 1
    precision: str | None = None
    zero_stage: int = 2
    offload_optimizer: bool = False
    offload_params: bool = False
    deepspeed_config: str | None = None
    context_parallel: int = 1

    def __post_init__(self):
        if self.name not in NAMES:
            raise UserError(f"strategy.name {self.name!r} is not one of {', '.join(NAMES)}")
        if self.accelerator not in ACCELERATORS:
            raise UserError(f"strategy.accelerator {self.accelerator!r} is not one of {', '.join(ACCELERATORS)}")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise UserError(f"strategy.precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.devices != "auto" and not (isinstance(self.devices, int) and self.devices >= 1):
            raise UserError(f"strategy.devices must be a number of at least 1 or \"auto\", got {self.devices!r}")
        if self.num_nodes < 1:
            raise UserError(f"strategy.num_nodes must be at least 1, got {self.num_nodes}")
        if self.zero_stage not in (1, 2, 3):
            raise UserError(f"strategy.zero_stage must be 1, 2 or 3, not {self.zero_stage}")
        if self.offload_params and self.zero_stage != 3:
            raise UserError("strategy.offload_params needs strategy.zero_stage 3")
        if not (type(self.context_parallel) is int and self.context_parallel == 1):  # the default needs no check
            from lm.mixers.context_parallel import check_layout

            check_layout(self.context_parallel)

    @property
    def on_gpu(self) -> bool:
        import torch

        return self.accelerator in ("gpu", "cuda") or (self.accelerator == "auto" and torch.cuda.is_available())

    @property
    def world_size(self) -> int:
        """Processes in all: devices per node ("auto": every GPU, or one CPU process) x nodes."""
        import torch

        devices = self.devices if isinstance(self.devices, int) else \
            (torch.cuda.device_count() if self.on_gpu else 1)
        return devices * self.num_nodes

    @property
    def data_parallel_size(self) -> int:
        """Replicas of the model that see different windows: the processes over the ranks that share a window."""
        from lm.mixers.context_parallel import check_layout

        check_layout(self.context_parallel, processes=self.world_size)
        return self.world_size // self.context_parallel

    @property
    def resolved_precision(self) -> str:
        """The precision the Trainer gets: Lightning's own name for an alias, and bf16-mixed for 16-mixed on the CPU,
        which Lightning would substitute itself (fp16 AMP does not run there; lm says so: precision_notice)."""
        if self.precision is None:
            return "bf16-mixed" if self.on_gpu else "32-true"
        precision = PRECISION_ALIASES.get(self.precision, self.precision)
        return "bf16-mixed" if precision == "16-mixed" and not self.on_gpu else precision

    @property
    def precision_notice(self) -> str | None:
        """The line that says the precision asked for is not the one trained in, or None."""
        if PRECISION_ALIASES.get(self.precision, self.precision) == "16-mixed" and not self.on_gpu:
            return (f"strategy.precision {self.precision} (fp16 AMP) is not available on the CPU; training in "
                    f"{self.resolved_precision}, as Lightning does")
        return None


def deepspeed_settings(cfg: StrategyConfig, grad_clip: float | None, micro_batch: int) -> dict:
    """The DeepSpeed JSON (if any) with the config's stage, offload, precision and clipping written over it."""
    settings = {}
    if cfg.deepspeed_config:
        path = Path(cfg.deepspeed_config)
        if not path.is_file():
            raise UserError(f"strategy.deepspeed_config: {path} not found")
        try:
            settings = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise UserError(f"strategy.deepspeed_config: {path} is not valid JSON ({err})") from None
    zero = dict(settings.get("zero_optimization", {}), stage=cfg.zero_stage)
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cfg.on_gpu}
    if cfg.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": cfg.on_gpu}
    settings["zero_optimization"] = zero
    # Lightning sets the accumulation from the Trainer; the micro-batch and clipping follow the run config.
    settings["train_micro_batch_size_per_gpu"] = micro_batch
    settings["gradient_clipping"] = grad_clip or 0.0
    if cfg.resolved_precision.startswith("bf16"):
        settings["bf16"] = {"enabled": True}
    return settings


def check_strategy(cfg: StrategyConfig, grad_clip: float | None, micro_batch: int) -> None:
    """What the Trainer would refuse in a traceback, or wait on forever, refused here in one line: `lm train` calls it
    before it writes anything, and build_strategy again."""
    import torch

    if cfg.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise UserError(f"strategy.accelerator {cfg.accelerator}: no GPU is available here "
                        "(torch.cuda.is_available() is false); use cpu or auto")
    if cfg.on_gpu and isinstance(cfg.devices, int) and cfg.devices > torch.cuda.device_count():
        raise UserError(f"strategy.devices {cfg.devices}: this machine has {torch.cuda.device_count()} GPU(s)")
    precision = cfg.resolved_precision
    if precision.startswith("transformer-engine") and not (cfg.on_gpu and find_spec("transformer_engine")):
        raise UserError(f"strategy.precision {cfg.precision} needs a GPU and the transformer_engine package")
    processes = cfg.devices if isinstance(cfg.devices, int) else None
    if cfg.name == "single" and (processes or 1) * cfg.num_nodes != 1:
        raise UserError(f"strategy.name single needs one device, not devices={cfg.devices} x num_nodes={cfg.num_nodes}")
    if cfg.name == "fsdp" and processes is None:
        raise UserError("strategy.name fsdp needs strategy.devices as a number (processes per node)")
    if cfg.name == "fsdp" and precision not in FSDP_PRECISIONS:
        raise UserError(f"strategy.name fsdp trains in {', '.join(FSDP_PRECISIONS)}, not strategy.precision "
                        f"{cfg.precision}")
    if cfg.name == "deepspeed":
        deepspeed_settings(cfg, grad_clip, micro_batch)  # its JSON file
        # DeepSpeed loads its C++ ops under torch's build lock: a stale one would hang it in silence
        # (lm.training.extension_lock), so it is checked before anything is written.
        wait_for_builds()
    if cfg.context_parallel > 1:
        if cfg.name not in ("auto", "ddp", "fsdp"):
            raise UserError(f"strategy.context_parallel {cfg.context_parallel} needs strategy.name ddp or fsdp, not "
                            f"{cfg.name}")
        cfg.data_parallel_size  # noqa: B018 - raises where the context groups do not divide the processes
