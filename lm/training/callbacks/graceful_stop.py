"""Stop a run cleanly on SIGUSR1, SIGTERM or SIGINT (a scheduler's preemption notice or time limit, Ctrl-C).

The listener (lm.training.stop_request) only sets a flag once training has started. After each optimizer step every
rank sums the flags (one all-reduce), so all of them agree to stop at the same step; they write a checkpoint of that
step together, the Trainer stops without the validation that would follow the step (the scheduler's warning is
short: the checkpoint is what must be done in it), and `lm train` exits with STOPPED_EXIT_CODE, which tells a job
script to requeue rather than to give up.

The ranks arm together: after a barrier, each arms, and one all-reduce says whether any had a request by then. A
notice to all of them in the instant between two ranks' arming ends one at once (not armed) and is noted by the other:
the agreement ends that one too, at once, rather than leaving it waiting for its peer at the first step.
"""

import lightning as L
import torch

from lm.training import stop_request


class GracefulStop(L.Callback):
    def __init__(self):
        self.stopped = False
        self._previous = {}
        self._seen_step = None
        self.arm = stop_request.arm  # replaced by tests' fault injection (lm.training.callbacks.faults)

    def on_fit_start(self, trainer, pl_module):
        self._seen_step = trainer.global_step

    def on_train_start(self, trainer, pl_module):
        # `lm train` listens from its first line; a caller in Python that trains in its own process handles the
        # signals here, in the main thread (Lightning has installed its own SIGTERM handler by now: replaced).
        if not stop_request.listening():
            self._previous = stop_request.handle_here()
        trainer.strategy.barrier()  # every rank is here: they arm within moments of each other
        self.arm()
        try:
            stop = self._anyone_requested(trainer, pl_module)
        except Exception:  # a rank that took the notice before arming has ended (gloo says its peer closed)
            if not stop_request.requested():
                raise
            stop = True
        stop_request.agree(stop)

    def _anyone_requested(self, trainer, pl_module) -> bool:
        flag = torch.tensor(float(stop_request.requested()), device=pl_module.device)
        return float(trainer.strategy.reduce(flag, reduce_op="sum")) > 0

    def on_exception(self, trainer, pl_module, exception):
        self._release()

    def _release(self):
        if self._previous:
            stop_request.restore(self._previous)
            self._previous = {}

    def on_fit_end(self, trainer, pl_module):
        self._release()
        if self.stopped:
            stop_request.clear()  # acted on; a later fit in this process starts afresh

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self._seen_step:
            return  # mid-accumulation: not an optimizer step boundary
        self._seen_step = trainer.global_step
        if not self._anyone_requested(trainer, pl_module):
            return
        self.stopped = True
        trainer.should_stop = True
        # Lightning validates after a step that sets should_stop (and at every val_check_interval): not this time.
        trainer.fit_loop.epoch_loop._skip_next_val = True
        checkpoint = next(c for c in trainer.callbacks if hasattr(c, "save_now"))
        checkpoint.save_now(trainer)
