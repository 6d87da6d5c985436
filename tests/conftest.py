"""Shared fixtures: a prepared copy of the bundled corpus (small vocabulary), offline settings, and Triton's
interpreter on a machine without CUDA; the order in which pytest-xdist's workers take the test files; the `launches`
and `long` markers and `make check`'s --inner-loop (tests/inner_loop.py)."""

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from filelock import FileLock
from inner_loop import Guard, launches, long

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# The interpreter runs lm's Triton kernels on the CPU (tests/test_op_mesa_triton.py). Triton reads this when it is
# first imported, by whichever test imports it first, so it is set before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist (`make test`: two workers, one per core), each worker and the processes it starts compute on one
# thread: two workers with two threads each would oversubscribe the cores, where OpenMP's waiting threads spin.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_thread():
    """A learning test's computation on one thread, in this process and in the processes it spawns (they inherit the
    environment), whatever launched it: `make test`'s xdist workers compute on one already, a plain `pytest FILE`
    would use every core, and a sum split over other threads rounds otherwise and can move a learning run as another
    seed would. Restored after."""
    saved = torch.get_num_threads(), {key: os.environ.get(key) for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved[0])
    for key, value in saved[1].items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


# `make test` runs the suite in two pytest-xdist workers, one per core (`-n 2 --dist loadfile --no-loadscope-reorder`):
# a worker takes a whole test file, so that a module's fixtures are made once, and the next file in this order when it
# is done. The files that took longest go first, so that neither worker is left with a long one at the end while the
# other idles. The durations are the suite's own: every run adds up each file's setup, call and teardown times and
# records them in tests/durations.json (merged with what it holds: a run of some files updates those). A file it does
# not know yet goes first, as a long one might.
DURATIONS = Path(__file__).with_name("durations.json")
_spent: dict[str, float] = {}


def recorded_durations() -> dict[str, float]:
    try:
        return json.loads(DURATIONS.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    known = recorded_durations()
    # stable: pytest's order within a file
    items.sort(key=lambda item: -known.get(item.path.name, float("inf")))
    for item in items:
        test = getattr(item, "originalname", item.name)
        if launches(item.path, test):
            item.add_marker(pytest.mark.launches)
        elif long(item.path, test):
            item.add_marker(pytest.mark.long)
    if config.getoption("inner_loop"):
        left_out = [item for item in items if item.get_closest_marker("launches") or item.get_closest_marker("long")]
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item not in left_out]


# `make check` (--inner-loop): the tests that start no process but the longest, each under a guard that refuses a
# process it starts all the same and fails it (tests/inner_loop.py). Armed from a test's setup, where its fixtures
# are made, to its teardown.
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--inner-loop", action="store_true",
                     help="make check: the tests that start no process but the longest (tests/inner_loop.py), each "
                     "failed if it starts one")


_guard: list[Guard] = []  # one per process, under --inner-loop


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "launches: starts processes (tests/inner_loop.py); left out by --inner-loop "
                            "(make check)")
    config.addinivalue_line("markers", "long: one of the longest tests that start no process (tests/inner_loop.py); "
                            "left out by --inner-loop (make check)")
    if config.getoption("inner_loop"):
        _guard.append(Guard())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    for guard in _guard:
        guard.arm()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    result = yield
    for guard in _guard:
        if guard.started:  # refused, and the refusal perhaps caught by the code that tried
            pytest.fail(f"this test started {len(guard.started)} process(es) ({', '.join(guard.started[:3])}), which "
                        "make check refused: name it in THROUGH_LM in tests/inner_loop.py", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    try:
        return (yield)
    finally:
        for guard in _guard:
            guard.disarm()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each test's phases, added to its file's time (in the process that writes the file: xdist's controller, which
    receives every worker's reports, or the one process)."""
    name = Path(report.nodeid.split("::")[0]).name
    _spent[name] = _spent.get(name, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    whole_files = not config.option.keyword and not any("::" in arg for arg in config.args) \
        and not config.getoption("inner_loop")  # make check leaves out some tests of a file
    if hasattr(config, "workerinput") or not _spent or not whole_files or session.shouldstop or session.shouldfail:
        return  # a worker, nothing ran, part of a file ran, or the run stopped early (its times would be short)
    merged = {**recorded_durations(), **{name: round(seconds, 1) for name, seconds in _spent.items()}}
    here = DURATIONS.parent  # a file since removed or renamed drops out of the record
    DURATIONS.write_text(json.dumps({name: seconds for name, seconds in merged.items() if (here / name).is_file()},
                                    indent=1, sort_keys=True) + "\n")


def made_once(request: pytest.FixtureRequest, tmp_path_factory, name: str, make: Callable[[Path], object]):
    """`make(folder)`'s JSON-able result, made once per test session also when several pytest-xdist workers ask: the
    first one makes it under a lock in the folder all workers' temporary folders share, the others wait for it and
    read the result it recorded there."""
    if not hasattr(request.config, "workerinput"):  # not in an xdist worker
        return make(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent
    with FileLock(shared / f"{name}.lock"):
        record = shared / f"{name}.json"
        if not record.is_file():
            record.write_text(json.dumps(make(tmp_path_factory.mktemp(name))))
        return json.loads(record.read_text())


@pytest.fixture(scope="session")
def kjv_data(request, tmp_path_factory) -> str:
    """The bundled KJV corpus prepared with a 512-token BPE (about 1.7M training tokens)."""
    from lm.data_prep.prepare import BUNDLED_CORPUS, prepare

    def make(folder: Path) -> str:
        prepare([str(BUNDLED_CORPUS)], str(folder / "data"), vocab_size=512, progress=False)
        return str(folder / "data")

    return made_once(request, tmp_path_factory, "kjv", make)


@pytest.fixture(scope="session")
def strategy_runs(kjv_data, request, tmp_path_factory) -> dict[str, Path]:
    """4 steps of every strategy on 2 processes, and of one process (tests/strategy_runs.py): made once, for
    tests/test_scale_out.py and for tests/test_slurm.py's 2-node runs."""
    from strategy_runs import train_every_strategy

    def make(folder: Path) -> dict[str, str]:
        return {name: str(path) for name, path in train_every_strategy(folder, kjv_data).items()}

    return {name: Path(path) for name, path in made_once(request, tmp_path_factory, "scale_out", make).items()}

