"""Where the run's processes go and how the model is spread over them: the `strategy` section of a run config.

The same config trains on one CPU, on 2 CPU processes (tests) and on many GPUs (production): only this section
changes. It becomes a Lightning strategy object, a precision and the Trainer's device arguments.
"""

from pathlib import Path

from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy

from lm.training.checkpoint_io import stream_save
from lm.training.launcher_watch import watch_launcher
from lm.training.strategy_config import StrategyConfig, check_strategy, deepspeed_settings


class StreamingDeepSpeedStrategy(DeepSpeedStrategy):
    """DeepSpeed whose shards are written as lm writes a single file (lm.training.checkpoint_io.stream_save), and
    whose save goes on to its end on every rank when a write fails (`write_error`, see stream_deepspeed_saves)."""

    write_error: Exception | None = None

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        engine, ds_optimizer = super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)
        stream_deepspeed_saves(engine, self)
        return engine, ds_optimizer


def stream_deepspeed_saves(engine, keeper) -> None:
    """DeepSpeed's default (torch) checkpoint engine saves through stream_save; another engine keeps its own.

    DeepSpeed's save meets the other ranks in barriers of its own, the last one after every rank's writes: a rank
    whose write raised (a full disk on its node) would leave the others waiting there for ever. So each write of the
    save (the directory, the shards, the recovery scripts, `latest`) keeps its error in `keeper.write_error` instead,
    and the rank writes nothing more of that save but walks on through DeepSpeed's barriers to its end;
    lm.training.checkpoint then tells every rank, and all end in one line."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    def kept(write):
        def write_unless_failed(*args, **kwargs):
            if keeper.write_error is None:
                try:
                    write(*args, **kwargs)
                except Exception as err:  # an OSError, or torch's writer's own error around a short write
                    keeper.write_error = err
        return write_unless_failed

    def save_checkpoint(save_dir, tag=None, client_state=None, save_latest=True, **kwargs):
        keeper.write_error = None
        tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
        # `latest` is written here, once DeepSpeed's save has met its last barrier, so that its failure is kept too.
        done = deepspeed_save(save_dir, tag=tag, client_state=client_state or {}, save_latest=False, **kwargs)
        if save_latest and engine.global_rank == 0:
            kept(lambda: (Path(save_dir) / "latest").write_text(tag))()
        return done

    if type(engine.checkpoint_engine) is TorchCheckpointEngine:
        deepspeed_save = engine.save_checkpoint
        engine.checkpoint_engine.save = kept(lambda state_dict, path: stream_save(state_dict, path))  # by keyword
        engine.checkpoint_engine.makedirs = kept(engine.checkpoint_engine.makedirs)
        engine._copy_recovery_script = kept(engine._copy_recovery_script)
        engine.save_checkpoint = save_checkpoint


class CPUDeepSpeedStrategy(StreamingDeepSpeedStrategy):
    """DeepSpeed on CPU processes with gloo, for tests and debugging only (production runs use GPUs).

    Lightning refuses DeepSpeed without CUDA; DeepSpeed itself runs ZeRO 1-3 on CPU. This skips Lightning's
    CUDA-only checks and gives DeepSpeed the local rank where it expects a CUDA device index.
    """

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:  # without the check that CUDA device indices match local ranks
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        import argparse

        import deepspeed

        parameters = filter(lambda p: p.requires_grad, model.parameters())
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank), config=self.config, model=model,
            model_parameters=parameters, optimizer=optimizer, lr_scheduler=lr_scheduler, dist_init_required=False)
        stream_deepspeed_saves(engine, self)
        return engine, ds_optimizer


def build_strategy(cfg: StrategyConfig, grad_clip: float | None, micro_batch: int):
    """The Lightning strategy (an object, or "auto") for the Trainer."""
    check_strategy(cfg, grad_clip, micro_batch)
    watch_launcher()  # a rank that Lightning started ends with the rank that started it (lm.training.launcher_watch)
    processes = cfg.devices if isinstance(cfg.devices, int) else None
    if cfg.name in ("auto", "single"):
        return "auto"
    backend = "nccl" if cfg.on_gpu else "gloo"
    if cfg.name == "ddp":
        return DDPStrategy(process_group_backend=backend)
    if cfg.name == "fsdp":
        return ModelParallelStrategy(data_parallel_size=processes * cfg.num_nodes, tensor_parallel_size=1,
                                     save_distributed_checkpoint=True)
    settings = deepspeed_settings(cfg, grad_clip, micro_batch)  # (check_strategy has waited for any build lock)
    strategy = StreamingDeepSpeedStrategy if cfg.on_gpu else CPUDeepSpeedStrategy
    return strategy(config=settings, process_group_backend=backend)
