"""Progress of a ladder stage whose runs train in worker processes, each into its own log (OUT/logs/NAME.log): every
EVERY seconds, one line on stderr with how many runs of the stage have ended and where each running one stands, read
from the last progress line `lm train` wrote to its log ("step N/M | ... | eta H:MM:SS"). With one worker the runs
train in the ladder's own process and print their progress themselves."""

import re
import sys
import threading
from pathlib import Path

EVERY = 30.0  # seconds between lines
STEP = re.compile(r"^step (\d+)/(\d+)\b.*?(?:\| eta (\S+))?$")


def where(log: Path) -> str | None:
    """Where a run stands by its log: "at step N/M (eta ...)" from its newest progress line, "starting" before its
    first, None before its log exists."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if found := STEP.match(line.strip()):
            step, total, eta = found.groups()
            return f"at step {step}/{total}" + (f" (eta {eta})" if eta else "")
    return "starting"


def line(stage: str, logs: dict[str, Path], ended) -> str | None:
    """The stage's progress: runs ended, and each started run's step; None before any run has a log."""
    done = [name for name in logs if ended(name)]
    running = {name: at for name, log in logs.items() if name not in done and (at := where(log)) is not None}
    if not done and not running:
        return None
    parts = [f"{name} {at}" for name, at in running.items()]
    return (f"lm compare ladder: {stage}: {len(done)} of {len(logs)} runs ended"
            + (f"; {'; '.join(parts)}" if parts else ""))


class StageProgress:
    """A daemon thread printing `line` every EVERY seconds while the stage trains (a with-block)."""

    def __init__(self, stage: str, logs: dict[str, Path], ended):
        self.stage, self.logs, self.ended = stage, logs, ended
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.report, daemon=True)

    def report(self) -> None:
        while not self.stop.wait(EVERY):
            text = line(self.stage, self.logs, self.ended)
            if text is not None:
                print(text, file=sys.stderr, flush=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
