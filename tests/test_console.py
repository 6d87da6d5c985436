"""lm.training.console: Lightning's banners and tips and the known deprecation warnings are dropped, by logger and exact
text, while other messages and warnings of the same loggers and categories still show. (A real run's console:
tests/test_progress.py and tests/test_demo.py.)"""

import logging
import warnings

from lightning.fabric.utilities.rank_zero import rank_zero_info as fabric_info
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lm.training.console import DropMessages, quiet_known_noise


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_the_banners_go_and_the_rest_of_the_same_loggers_stays():
    quiet_known_noise()
    quiet_known_noise()  # idempotent: one filter per logger
    loggers = ["lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero", "DeepSpeed"]
    assert all(sum(isinstance(f, DropMessages) for f in logging.getLogger(name).filters) == 1 for name in loggers)
    records = Records()
    for name in loggers:
        logging.getLogger(name).addHandler(records)
    try:
        rank_zero_info("GPU available: False, used: False")
        rank_zero_info("TPU available: False, using: 0 TPU cores")
        rank_zero_info("💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]")
        fabric_info("GPU available: True (cuda), used: True")
        rank_zero_info("`Trainer.fit` stopped: `max_steps=4` reached.")
        logging.getLogger("DeepSpeed").warning("Setting accelerator to CPU. If you have GPU or other accelerator, we "
                                               "were unable to detect it.")
        rank_zero_info("`Trainer.fit` stopped: No training batches.")  # a real problem
        rank_zero_info("GPU available but not used. You can set it by doing `Trainer(accelerator='gpu')`.")
        logging.getLogger("DeepSpeed").warning("a DeepSpeed warning")
    finally:
        for name in loggers:
            logging.getLogger(name).removeHandler(records)
    assert records.messages == ["`Trainer.fit` stopped: No training batches.",
                                "GPU available but not used. You can set it by doing `Trainer(accelerator='gpu')`.",
                                "a DeepSpeed warning"]


def test_the_known_deprecation_goes_and_other_warnings_stay():
    from lightning.pytorch.utilities._pytree import _tree_flatten

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_known_noise()
        _tree_flatten(1)  # Lightning's helper builds torch's deprecated LeafSpec
        warnings.warn("`isinstance(x, Other)` is deprecated", FutureWarning, stacklevel=1)
        warnings.warn("a real warning", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["`isinstance(x, Other)` is deprecated", "a real warning"]


def test_without_the_filters_the_deprecation_is_there():
    """The message the filter matches is the one torch gives (a torch that changes it makes this fail)."""
    from lightning.pytorch.utilities._pytree import _tree_flatten

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _tree_flatten(1)
    assert any("`isinstance(treespec, LeafSpec)` is deprecated" in str(w.message) for w in caught)
