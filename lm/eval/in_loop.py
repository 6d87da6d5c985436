"""In-loop evaluation (the run config's `eval` section, lm.training.config.InLoopEvalConfig): every `eval.every`
optimizer steps, lm-eval tasks and the long-context probes run on the current weights, through the same `lm` model that
`lm eval harness` uses, and their scores are logged beside the loss as eval/TASK/METRIC.

Every rank evaluates everything (the same requests in the same order), so the forward passes of a sharded model
(FSDP2, ZeRO-3) meet on every rank, and every rank holds the same scores; they are compared across ranks, and a
difference stops the run rather than being logged from one rank alone.
"""

import os
from pathlib import Path
from unittest import mock

import lightning as L
import torch

from lm.training.config import InLoopEvalConfig, RunConfig
from lm.training.rng import rng_state, set_rng_state
from lm.util.errors import UserError


def write_probe_tasks(cfg: InLoopEvalConfig, tokenizer_file: Path, out_dir: Path) -> list[str]:
    """The probes as lm-eval tasks in out_dir (depths spread over [0, 1]); their task names."""
    from tokenizers import Tokenizer

    from lm.eval.longctx.probes import make_example
    from lm.eval.longctx.tasks import write_tasks

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    depths = [i / max(1, cfg.probe_samples - 1) for i in range(cfg.probe_samples)]
    examples = {probe: [(cfg.probe_length, depth, make_example(probe, tokenizer, cfg.probe_length, depth, i))
                        for i, depth in enumerate(depths)] for probe in cfg.probes}
    return write_tasks(examples, out_dir, "noise", max_new_tokens=16)


def in_loop_callbacks(config: RunConfig) -> list[L.Callback]:
    """What lm.training.train.train takes as `callbacks` for the config's `eval` section (none if eval.every is 0)."""
    return [InLoopEval(config.eval, Path(config.run_dir))] if config.eval.every else []


class InLoopEval(L.Callback):
    evaluates_in_loop = True  # what lm.training.train looks for when the config asks for in-loop evaluation

    def __init__(self, cfg: InLoopEvalConfig, run_dir: Path):
        self.cfg, self.run_dir = cfg, run_dir
        self.tasks, self.task_manager, self._seen_step = list(cfg.tasks), None, None

    def on_fit_start(self, trainer, pl_module):
        from lm_eval.tasks import TaskManager

        self._seen_step, self.tasks = trainer.global_step, list(self.cfg.tasks)
        paths = [self.cfg.include_path] if self.cfg.include_path else []
        if self.cfg.probes:
            probes_dir = self.run_dir / "eval" / "in_loop"
            if trainer.is_global_zero:
                self.tasks += write_probe_tasks(self.cfg, self.run_dir / "tokenizer.json", probes_dir)
            else:
                self.tasks += [f"longctx_{probe}" for probe in self.cfg.probes]
            trainer.strategy.barrier()
            paths.append(str(probes_dir))
        # lm-eval's own tasks need its index (about 10 s to build): only when the local YAMLs do not have them all.
        for include_defaults in (False, True):
            self.task_manager = TaskManager(include_path=paths or None, include_defaults=include_defaults)
            if not (missing := [t for t in self.tasks if not self.task_manager.match_tasks([t])]):
                return
        raise UserError(f"eval.tasks: lm-eval has no task {', '.join(missing)}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self._seen_step:
            return  # mid-accumulation: not an optimizer step boundary
        self._seen_step = trainer.global_step
        if trainer.global_step % self.cfg.every == 0:
            scores = self.evaluate(trainer, pl_module)
            if trainer.is_global_zero:  # on the row of the step that made these weights, beside its loss
                for logger in trainer.loggers:
                    logger.log_metrics(scores, step=trainer.global_step - 1)

    def evaluate(self, trainer, pl_module) -> dict[str, float]:
        import lm_eval
        from tokenizers import Tokenizer

        from lm.eval.harness import LMHarness

        model = pl_module.model
        was_training = model.training
        harness = LMHarness(model=model, tokenizer=Tokenizer.from_file(str(self.run_dir / "tokenizer.json")),
                            batch_size=self.cfg.batch_size, device=str(pl_module.device))
        # lm-eval returns results only where LOCAL_RANK is 0 (it takes any other for a tensor-parallel worker); here
        # every rank is a whole evaluator of its own. It seeds Python's, NumPy's and torch's generators: the run goes
        # on with its own streams, as a run that is not evaluated does.
        state, devices = rng_state(), [pl_module.device] if pl_module.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), mock.patch.dict(os.environ, {"LOCAL_RANK": "0"}):
                results = lm_eval.simple_evaluate(model=harness, tasks=self.tasks, task_manager=self.task_manager,
                                                  limit=self.cfg.limit, bootstrap_iters=0,
                                                  verbosity="ERROR")["results"]
        finally:
            set_rng_state(state)
        model.train(was_training)
        scores = {f"eval/{task}/{metric.split(',')[0]}": float(value) for task, metrics in results.items()
                  for metric, value in metrics.items() if isinstance(value, (int, float)) and "stderr" not in metric}
        if not scores:
            return scores
        values = torch.tensor(list(scores.values()), dtype=torch.float64, device=pl_module.device)
        gathered = trainer.strategy.all_gather(values)  # [world, n] (or [n] on one process)
        if not torch.equal(gathered.reshape(-1, len(scores)).amin(0), gathered.reshape(-1, len(scores)).amax(0)):
            raise RuntimeError(f"in-loop evaluation at step {trainer.global_step}: the ranks' scores differ")
        return scores
