"""What `lm train` keeps off the console: the banners, tips and known deprecation warnings of the libraries it runs on.
Each is matched by its logger and the exact start of its text, so every other message and warning still shows."""

import logging
import warnings

# logger -> the starts of the messages it drops. Lightning's rank-zero logger is the fabric one until
# lightning.pytorch is imported, and lightning.pytorch's after. A resume's two (`lm train` says "resuming from ..."
# itself, once).
_RANK_ZERO = ("GPU available: ", "TPU available: ", "💡 Tip: ", "`Trainer.fit` stopped: `max_steps=",
              "Restoring states from the checkpoint path at ", "Restored all states from the checkpoint at ")
BANNERS = {
    "lightning.pytorch.utilities.rank_zero": _RANK_ZERO,
    "lightning.fabric.utilities.rank_zero": _RANK_ZERO,
    "lightning.pytorch.accelerators.cuda": ("LOCAL_RANK: ",),  # "LOCAL_RANK: 0 - CUDA_VISIBLE_DEVICES: [0]"
    "DeepSpeed": ("Setting accelerator to CPU. If you have GPU or other accelerator",),  # on every CPU-only machine
}
# (category, a regular expression matched at the start of the message)
KNOWN_WARNINGS = [
    # Lightning 2.6's own _pytree helper builds torch's deprecated LeafSpec; nothing a user can change.
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
    # val/ppl and a mixture's val/loss are logged after their reduction over the ranks (LMModule): the same value on
    # every rank, which sync_dist would all-reduce again for nothing.
    (UserWarning, r"It is recommended to use `self\.log\('val/(ppl|loss)"),
    # Every resume: the checkpoints folder holds the checkpoints it resumes from, which lm keeps and prunes itself
    # (lm.training.step_checkpoint).
    (UserWarning, r"Checkpoint directory .* exists and is not empty\."),
]


class DropMessages(logging.Filter):
    """Drops the records whose message starts with one of `starts`."""

    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


def quiet_known_noise() -> None:
    """Drop the known banners, tips and warnings (BANNERS, KNOWN_WARNINGS) from here on; idempotent."""
    for name, starts in BANNERS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessages) for f in logger.filters):
            logger.addFilter(DropMessages(starts))
    for category, message in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
