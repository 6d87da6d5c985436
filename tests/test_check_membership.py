"""`make check`'s membership (tests/inner_loop.py): a test that starts processes is found from what it calls, through
its fixtures and helpers; no test file imports a way to start processes with none of its tests found; the names
THROUGH_LM and LONG give exist; and the guard of --inner-loop refuses and records what a test starts."""

import ast
import multiprocessing
import multiprocessing.process
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from inner_loop import LONG, TESTS, THROUGH_LM, Guard, LaunchRefused, called_launchers, launches

LAUNCHING_MODULES = {"subprocess", "multiprocessing", "torch.multiprocessing", "concurrent.futures", "lm.util.workers"}

SYNTHETIC = '''
import subprocess

import pytest
from strategy_runs import train, train_here


@pytest.fixture
def served():
    return subprocess.Popen(["sleep", "1"])


def helper():
    return forked()


def forked():
    import os
    return os.fork()


def test_calls_subprocess():
    subprocess.run(["true"])


def test_takes_a_launching_fixture(served):
    pass


def test_calls_a_helper_that_forks():
    helper()


def test_trains_through_strategy_runs(tmp_path):
    train(tmp_path, tmp_path)


def test_asks_for_the_fixture_by_name(request):
    request.getfixturevalue("served")


def test_takes_conftests_strategy_runs(strategy_runs):
    pass


def test_trains_in_this_process(tmp_path):
    train_here(tmp_path, tmp_path)


def test_names_a_type_of_subprocess_only():
    return subprocess.CompletedProcess


def test_holds_a_string_that_names_a_helper():
    assert "helper"
'''


def test_the_tests_that_start_processes_are_found_through_fixtures_helpers_and_strategy_runs(tmp_path):
    path = tmp_path / "test_synthetic.py"
    path.write_text(SYNTHETIC)
    found = called_launchers(path)
    assert found == {"test_calls_subprocess": {"subprocess.run"},
                     "test_takes_a_launching_fixture": {"subprocess.Popen", "Popen"},
                     "test_calls_a_helper_that_forks": {"os.fork"},
                     "test_trains_through_strategy_runs": {"subprocess.run"},  # strategy_runs.train -> lm -> subprocess
                     "test_asks_for_the_fixture_by_name": {"subprocess.Popen", "Popen"},
                     "test_takes_conftests_strategy_runs": {"subprocess.run"}}, found
    # In-process training runs git for the run's record: what the source does not show, THROUGH_LM says.
    assert not launches(path, "test_trains_in_this_process")


def test_through_lm_marks_what_the_source_does_not_show(tmp_path, monkeypatch):
    path = tmp_path / "test_synthetic.py"
    path.write_text(SYNTHETIC)
    monkeypatch.setitem(THROUGH_LM, path.name, {"test_trains_in_this_process"})
    assert launches(path, "test_trains_in_this_process") and not launches(path, "test_names_a_type_of_subprocess_only")


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
    return modules


def test_a_test_file_that_imports_a_way_to_start_processes_has_its_launching_tests_found():
    """A blind spot of the finder (a launch through a class, a lambda, a method) would leave a file that imports
    subprocess or a worker pool with none of its tests marked: such a file is found here, to be named in THROUGH_LM
    or the finder taught."""
    missed = [path.name for path in sorted(TESTS.glob("test_*.py"))
              if imported_modules(path) & LAUNCHING_MODULES and not called_launchers(path)
              and path.name not in THROUGH_LM]
    assert not missed, missed


def test_the_names_through_lm_and_long_give_are_tests_that_exist():
    for name, tests in [*THROUGH_LM.items(), *LONG.items()]:
        assert (TESTS / name).is_file(), name
        defined = {node.name for node in ast.parse((TESTS / name).read_text()).body
                   if isinstance(node, ast.FunctionDef) and node.name.startswith("test")}
        assert tests <= defined, (name, tests - defined)


@pytest.fixture
def guard(monkeypatch) -> Iterator[Guard]:
    """A guard of this test's own, its hook on multiprocessing's start undone after; its audit hook stays (Python
    has no way to remove one), disarmed."""
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", multiprocessing.process.BaseProcess.start)
    guard = Guard()
    yield guard
    guard.disarm()


def test_the_guard_refuses_and_records_the_audited_starts_while_armed_only(guard):
    """Its audit hook, called as Python calls it (raising the events here would be seen by the guard of --inner-loop
    itself)."""
    git = ("/usr/bin/git", ["git", "rev-parse"], None, None)
    guard._audit("subprocess.Popen", git)
    assert guard.started == []
    guard.arm()
    for event, args in (("subprocess.Popen", git), ("os.fork", ())):
        with pytest.raises(LaunchRefused, match="THROUGH_LM"):
            guard._audit(event, args)
    guard._audit("open", ("x", "r", 0))
    assert guard.started == ["subprocess.Popen git", "os.fork"]
    guard.disarm()
    guard._audit("os.fork", ())
    assert len(guard.started) == 2
    guard.arm()
    assert guard.started == []


def test_the_guard_refuses_a_subprocess_and_a_spawned_process(guard):
    guard.arm()
    with pytest.raises(LaunchRefused):
        subprocess.run(["true"])
    process = multiprocessing.get_context("spawn").Process(target=int)
    with pytest.raises(LaunchRefused):
        process.start()
    guard.disarm()
    assert guard.started == ["subprocess.Popen true", "a multiprocessing SpawnProcess"], guard.started
    assert process.pid is None  # never started
