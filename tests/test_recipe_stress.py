"""Stress (slow, `make test-all`): the long-context Gated DeltaNet recipe, which hung once in a local run of
tests/test_recipes.py and was not caught again, trained RUNS times in one launch of 4 processes as that test launches
it: after the attention recipe, in the same ranks (FSDP2, context_parallel 4, bf16-mixed, shrunk as that test shrinks
it). Each training must end; one that waits past WAIT_S dumps every rank's threads (faulthandler) and fails."""

import faulthandler
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import test_recipes
from strategy_runs import environment

RECIPES = ["long_context/attention_1b_32k.yaml", "long_context/gated_deltanet_1b_32k.yaml"]
RUNS = 50
WAIT_S = 300  # one training takes 6-18 s here on 2 busy cores


@pytest.mark.slow
def test_the_long_context_gated_deltanet_recipe_ends_every_time(kjv_data, tmp_path):
    launch = subprocess.run([sys.executable, __file__, kjv_data, str(tmp_path), str(RUNS)], env=environment(),
                            capture_output=True, text=True, timeout=60 * 60)
    record = tmp_path / "done.json"
    done = json.loads(record.read_text()) if record.is_file() else []
    assert launch.returncode == 0 and len(done) == RUNS + 1, f"{len(done)} ended:\n{launch.stderr[-5000:]}"
    assert all(code == 0 for _, code in done), done


if __name__ == "__main__":  # the launch: python tests/test_recipe_stress.py DATA OUT RUNS
    data, out, runs = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    done = []
    for i, name in enumerate([RECIPES[0]] + [RECIPES[1]] * runs):
        faulthandler.dump_traceback_later(WAIT_S, exit=True)
        code, stderr = test_recipes.train_here(name, data, out / f"{i:03d}")
        faulthandler.cancel_dump_traceback_later()
        if os.environ.get("LOCAL_RANK", "0") == "0":
            done.append((name, code))
            (out / "done.json").write_text(json.dumps(done))
        if code != 0:
            print(stderr[-3000:], file=sys.stderr)
            sys.exit(code)
