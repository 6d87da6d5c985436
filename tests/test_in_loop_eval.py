"""In-loop evaluation (lm.eval.in_loop) leaves the run as it found it: lm-eval seeds Python's, NumPy's and torch's
generators for itself, and a run evaluated in the loop must go on with the random streams of one that is not, or the
two would no longer be the same run (the scores against `lm eval harness`: tests/test_scale_out.py)."""

import torch
from strategy_runs import ONE_PROCESS, base_config, in_loop_eval, train_here, write_local_tasks


def test_a_run_evaluated_in_the_loop_checkpoints_the_random_state_of_one_that_is_not(kjv_data, tmp_path):
    config = base_config(tmp_path, kjv_data, steps=4, ckpt_every=4)  # evaluated at step 4, then checkpointed
    flags = {"plain": [], "evaluated": in_loop_eval(write_local_tasks(tmp_path / "tasks"))}
    states = {}
    for name, extra in flags.items():
        result = train_here(config, tmp_path / name, *ONE_PROCESS, *extra)
        assert result.returncode == 0, result.stderr[-3000:]
        checkpoint = torch.load(tmp_path / name / "checkpoints" / "step=00000004.ckpt", weights_only=True)
        states[name] = checkpoint["rng"], checkpoint["state_dict"]
    (plain_rng, plain_weights), (evaluated_rng, evaluated_weights) = states["plain"], states["evaluated"]
    assert list((tmp_path / "evaluated").glob("logs/version_*/metrics.csv"))[0].read_text().count("eval/") >= 2
    assert torch.equal(plain_rng["torch"], evaluated_rng["torch"])
    assert plain_rng["python"] == evaluated_rng["python"] and plain_rng["numpy"] == evaluated_rng["numpy"]
    assert all(torch.equal(plain_weights[k], evaluated_weights[k]) for k in plain_weights)
