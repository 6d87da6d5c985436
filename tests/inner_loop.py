"""Which tests `make check` runs, the inner loop while editing (`make test` runs them all): it leaves out the tests
that start processes (marked `launches`) and the longest of the others (marked `long`, LONG below).

A test starts a process when it, a fixture it takes or a helper it calls runs another program (an `lm` command line,
torchrun, pip, git), starts Python processes (multiprocessing or torch's spawn, lm.util.workers' pool, a strategy
with several devices, DataLoader workers) or forks. Such a test is found two ways:

- from the source (`called_launchers`): a test whose body, or a fixture it takes, or a function it calls in its module,
  in tests/conftest.py or in a helper module of tests/ (strategy_runs.train...), names a launcher (subprocess,
  multiprocessing, torch's start_processes or spawn, lm.util.workers' run_jobs, os.fork, os.system);
- by name (`THROUGH_LM`): a test that starts processes through lm's own code, which its source does not show (an
  in-process `lm train` runs git for the run's record; a command's worker pool).

`make check` (pytest --inner-loop) leaves the marked tests out and runs the others under `Guard`, which refuses a
process that a test starts all the same and fails the test, naming what it started: that test then belongs in
THROUGH_LM.
"""

import ast
import multiprocessing.process
import os
import sys
from functools import cache
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# What a test calls to start a process: these functions of subprocess and os, and these names anywhere (imported, or
# as an attribute: mp.start_processes, ctx.Process).
LAUNCHING_CALLS = {"subprocess.run", "subprocess.Popen", "subprocess.call", "subprocess.check_call",
                   "subprocess.check_output", "os.fork", "os.forkpty", "os.system", "os.posix_spawn", "os.execv",
                   "os.execvp", "os.execve", "os.execvpe"}
LAUNCHING_NAMES = {"Popen", "Process", "Pool", "ProcessPoolExecutor", "start_processes", "spawn", "run_jobs"}

# test file -> the tests in it that start processes through lm's code, which their source does not show: found by the
# guard of `make check` (git: an in-process `lm train`'s run record; a SpawnProcess: lm.util.workers' pool or
# prepare's workers; a Process: DataLoader workers; g++: torch.compile's C++ code; wandb-core; python: a bench's
# measured process).
THROUGH_LM: dict[str, set[str]] = {
    "test_bench_data.py": {"test_bench_data_figures"},
    "test_cg_at_inference.py": {"test_a_bad_setting_is_refused_in_one_line_before_anything_is_written",
                                "test_a_setting_builds_its_own_model_and_leaves_the_trained_one_alone",
                                "test_every_setting_against_the_flops_it_spent"},
    "test_checkpoint_save_bench.py": {"test_a_save_streams_into_the_run_directory_alone"},
    "test_compare_demo.py": {"test_compare_demo_fast_mode_trains_runs_probes_mqar_and_reports"},
    "test_compile_inductor.py": {"test_inductor_compiled_training_steps_equal_eager"},
    "test_console.py": {"test_a_commands_stdout_is_its_result_alone",
                        "test_a_resume_says_so_once_and_lightnings_banners_stay_off",
                        "test_a_runs_files_take_the_users_umask",
                        "test_lm_train_starts_by_saying_the_parameter_count_and_each_layers_mixer"},
    "test_data.py": {"test_every_window_once_per_epoch_across_2_ranks_and_2_workers",
                     "test_resume_and_world_size_change_keep_the_global_order",
                     "test_val_windows_0_trains_without_validation"},
    "test_demo.py": {"test_demo_runs_end_to_end_and_beats_the_unigram_bar"},
    "test_documents.py": {"test_compare_documents_trains_both_settings_and_tabulates_them",
                          "test_per_position_nll_with_resets_equals_each_document_alone"},
    "test_eval_wandb.py": {"test_eval_results_go_to_the_runs_own_wandb_run"},
    "test_flex_attention.py": {"test_compiled_cpu_flex_kernel_equals_sdpa"},
    "test_harness.py": {"test_a_suite_whose_data_is_missing_offline_names_the_task",
                        "test_lm_eval_harness_command_writes_results_into_the_run",
                        "test_the_based_task_yamls_run_through_lm_eval_on_local_data"},
    "test_icl.py": {"test_one_mesa_layer_solves_the_regression_and_linear_attention_takes_one_gd_step"},
    "test_in_loop_eval.py": {"test_a_run_evaluated_in_the_loop_checkpoints_the_random_state_of_one_that_is_not"},
    "test_ladder.py": {"test_a_rerun_trains_nothing", "test_a_run_that_diverges_ends_as_diverged_with_an_infinite_loss",
                       "test_an_iso_flop_ladder_trains_every_size_at_every_budget",
                       "test_the_fit_takes_each_runs_final_loss_and_compute", "test_the_report_joins_lm_compare_report",
                       "test_the_sweep_picks_the_best_grid_lr_and_the_rule_carries_it_up"},
    "test_ladder_verdicts.py": {"test_a_fit_that_does_not_converge_says_so_in_the_report",
                                "test_a_small_ladders_report_says_no_more_than_its_runs",
                                "test_a_ladder_whose_runs_ran_two_codes_is_refused_in_one_line",
                                "test_a_pure_power_law_fits_with_e_at_zero_and_the_built_held_out_error",
                                "test_choose_takes_the_fewest_cg_steps_shown_within_the_tolerance",
                                "test_e_at_its_bound_is_not_identified",
                                "test_every_rung_sweeps_the_lr_carried_up_and_the_rule_finds_its_slope",
                                "test_the_held_out_error_matches_the_miss_built_into_the_largest_rung",
                                "test_the_synthetic_ladders_verdicts_say_only_what_its_runs_show",
                                "test_two_seeds_read_the_data_in_two_orders_unless_the_ladder_fixes_it"},
    "test_longctx.py": {"test_the_probes_as_lm_eval_tasks_give_the_same_generations_and_scores"},
    "test_mesa_ablation.py": {"test_mesa_ablation_trains_tables_and_reports_a_variant"},
    "test_mixture.py": {"test_a_run_draws_each_source_at_its_weight_and_logs_its_tokens",
                        "test_bad_eval_of_a_mixture_is_one_line_and_writes_nothing",
                        "test_each_data_writes_its_own_folder",
                        "test_eval_ppl_of_a_mixture_run_scores_every_source_and_their_weighted_mean",
                        "test_loader_shares_resume_and_world_size_keep_the_global_order",
                        "test_resume_mid_run_trains_the_same_batches_to_the_same_weights",
                        "test_validation_reports_each_source_and_their_weighted_mean"},
    "test_model_commands.py": {"test_export_refuses_an_out_that_holds_another_model_unless_overwrite",
                               "test_generate_warns_when_the_prompt_and_new_tokens_reach_past_max_seq_len",
                               "test_ppl_records_the_trained_length_and_warns_past_max_seq_len"},
    "test_mqar_grid.py": {"test_quick_grid_writes_the_table_and_the_figure",
                          "test_resume_runs_only_the_missing_cells_and_refuses_another_grids"},
    "test_optimizer_config.py": {"test_each_parameter_gets_the_configured_weight_decay",
                                 "test_each_step_applies_the_schedules_learning_rate",
                                 "test_one_step_decays_each_parameter_by_its_configured_rate"},
    "test_preflight.py": {"test_a_resume_on_another_schedule_is_refused_unless_allowed_and_then_recorded"},
    "test_prepare_parallel.py": {"test_a_mixture_of_a_recipe_of_files_trains",
                                 "test_a_recipe_as_plan_parts_and_merge_writes_the_same_bytes",
                                 "test_a_recipe_writes_a_dataset_per_source_and_the_mixture",
                                 "test_each_source_of_a_recipe_is_the_dataset_of_its_records_alone",
                                 "test_lm_train_reads_the_mixture_a_recipe_writes",
                                 "test_workers_write_the_same_bytes"},
    "test_rank_monitor.py": {"test_a_hybrid_run_logs_the_ranks_of_its_attention_layers",
                             "test_decay_on_the_attention_matrices_lowers_the_qk_rank"},
    "test_resume_accumulation.py": {"test_a_resume_with_another_accumulation_steps_and_validates_on_its_steps"},
    "test_revision_ab.py": {"test_an_unknown_revision_is_one_clear_error",
                            "test_op_at_head_is_read_from_git_and_matches_the_working_tree"},
    "test_stops.py": {"test_a_run_ends_with_one_validation_of_its_last_step",
                      "test_a_stop_checkpoints_its_step_without_a_validation_and_a_second_notice_changes_nothing"},
    "test_train.py": {"test_a_flipped_byte_is_caught_and_the_previous_checkpoint_used",
                      "test_mesa_run_logs_its_solves_gates_and_conditioning",
                      "test_non_finite_gradients_skip_their_steps_and_enough_in_a_row_stop_the_run",
                      "test_perplexity_at_longer_lengths_and_against_a_reference",
                      "test_perplexity_by_position_and_generation", "test_rerun_in_the_same_directory_continues",
                      "test_resume_gives_identical_losses_and_weights",
                      "test_run_directory_holds_config_logs_checkpoints_and_tokenizer",
                      "test_sigterm_mid_accumulation_stops_at_the_step_boundary_and_resumes_exactly"},
}


def _references(node: ast.AST) -> tuple[set[str], set[str], set[str]]:
    """(the launchers a function names, the names it refers to: plain names, attributes and its parameters, which
    name its fixtures; the strings it holds, which may name a fixture too: request.getfixturevalue("launched"))."""
    launchers, names, strings = set(), set(), set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            names.add(sub.id)
        elif isinstance(sub, ast.arg):
            names.add(sub.arg)
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            strings.add(sub.value)
        elif isinstance(sub, ast.Attribute):
            names.add(sub.attr)
            if isinstance(sub.value, ast.Name) and f"{sub.value.id}.{sub.attr}" in LAUNCHING_CALLS:
                launchers.add(f"{sub.value.id}.{sub.attr}")
    return launchers | (names & LAUNCHING_NAMES), names, strings


def _is_fixture(node: ast.FunctionDef) -> bool:
    return any("fixture" in ast.unparse(decorator) for decorator in node.decorator_list)


@cache
def _functions(path: Path) -> dict[str, tuple[Path, ast.FunctionDef]]:
    """A module's top-level functions (fixtures included), and those of the modules of tests/ it imports (also inside a
    function: `from strategy_runs import train`, `import test_context_parallel`), by the names it calls them by: name
    -> (the module that defines it, its definition)."""
    tree = ast.parse(path.read_text())
    functions = dict(_own_functions(path))
    _importing.add(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and (TESTS / f"{node.module}.py").is_file():
            helper = TESTS / f"{node.module}.py"
            helper = _own_functions(helper) if helper in _importing else _functions(helper)  # two import each other
            functions |= {alias.asname or alias.name: helper[alias.name] for alias in node.names
                          if alias.name in helper}
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if (TESTS / f"{alias.name}.py").is_file():  # called as module.function: by the function's name
                    functions = {**_own_functions(TESTS / f"{alias.name}.py"), **functions}
    _importing.discard(path)
    return functions


_importing: set[Path] = set()  # the modules whose imports are being followed


@cache
def _own_functions(path: Path) -> dict[str, tuple[Path, ast.FunctionDef]]:
    """A module's top-level functions by name (a module of tests/ that another imports)."""
    tree = ast.parse(path.read_text())
    return {node.name: (path, node) for node in tree.body if isinstance(node, ast.FunctionDef)}


@cache
def called_launchers(path: Path) -> dict[str, set[str]]:
    """Test name -> the launchers its source reaches (through the fixtures it takes and the functions it calls, each
    looked up in its own module, in tests/conftest.py's fixtures and in the helper modules of tests/), for the tests of
    the file that reach any."""
    fixtures = _functions(TESTS / "conftest.py")

    def reached(module: Path, node: ast.FunctionDef, seen: set[int]) -> set[str]:
        seen.add(id(node))
        launchers, names, strings = _references(node)
        known = {**fixtures, **_functions(module)}
        called = [known[name] for name in names if name in known]
        called += [known[name] for name in strings if name in known and _is_fixture(known[name][1])]
        return launchers.union(*(reached(*entry, seen) for entry in called if id(entry[1]) not in seen))

    tests = [(name, entry) for name, entry in _functions(path).items() if name.startswith("test") and entry[0] == path]
    return {name: found for name, entry in tests if (found := reached(*entry, set()))}


# test file -> its tests that start no process but take longest: the functions whose runs took 15 s or more under
# `pytest --inner-loop --durations=0` on 2 cores at a load of about 8 (a few seconds each alone), which were over half
# of its time (docs/install.md, "make check"): torch.compile, Triton's interpreter, the paper sizes' parameter search,
# learning runs. Left to `make test`, so that `make check` stays within 3 minutes.
LONG: dict[str, set[str]] = {
    "test_bench_compile.py": {"test_compiled_block_equals_eager", "test_bench_compile_command"},
    "test_compare_plan.py": {"test_written_configs_load_and_form_the_sweep", "test_every_arch_matches_within_2_percent",
                             "test_data_sets_the_prepared_data_of_every_config",
                             "test_impossible_requests_are_user_errors",
                             "test_the_window_of_swa_is_half_the_planned_length_unless_the_base_sets_it"},
    "test_configs.py": {"test_paper_size_configs_are_what_the_generator_writes",
                        "test_formula_parameter_count_equals_the_built_model"},
    "test_hf.py": {"test_greedy_generate_is_the_original_models_generate"},
    "test_kernel_self_check.py": {"test_each_shape_class_is_checked_once", "test_the_triton_kernels_pass_and_are_kept",
                                  "test_the_cost_bench", "test_a_wrong_kernel_is_caught_once",
                                  "test_the_setting_turns_the_check_off"},
    "test_ladder.py": {"test_a_plan_says_the_epochs_each_run_reads_and_what_the_target_needs"},
    "test_ladder_statistics.py": {"test_an_earlier_report_is_reread_by_todays_instrument"},
    "test_memory_plan.py": {"test_the_plan_is_within_10_percent_of_a_measured_cpu_peak"},
    "test_mqar_grid.py": {"test_a_cell_that_can_learn_beats_chance"},
    "test_op_mesa_triton.py": {"test_matches_the_exact_solve", "test_bfloat16_inputs_are_solved_in_float32",
                               "test_step_for_step_the_torch_code"},
    "test_prepare_parallel.py": {"test_a_sample_trained_tokenizer_is_deterministic_and_in_the_fingerprint"},
    "test_scaling_fit.py": {"test_intervals_cover_the_truth_at_about_the_nominal_rate"},
    "test_state_tracking.py": {"test_a_solved_run_stops_early_with_its_curve_and_beta_in_0_1_does_not_solve_parity"},
}


def long(path: Path, test: str) -> bool:
    """Whether the test (its function's name) of the test file is one of the longest that start no process."""
    return test in LONG.get(path.name, set())


def launches(path: Path, test: str) -> bool:
    """Whether the test (its function's name) of the test file starts processes."""
    return test in called_launchers(path) or test in THROUGH_LM.get(path.name, set())


class LaunchRefused(RuntimeError):
    """A process start that the guard of --inner-loop refused."""


class Guard:
    """While armed, refuses every process start, and records it: Python's audit events for fork, exec, spawn and
    subprocess, and multiprocessing's Process.start (a spawned process passes no audit event). Refused, the launch
    costs nothing and leaves no process behind; recorded, it fails the test even where the code that tried it caught
    the error."""

    EVENTS = {"os.fork", "os.forkpty", "os.system", "os.posix_spawn", "os.exec", "os.spawn", "subprocess.Popen"}

    def __init__(self):
        self.armed = False
        self.started: list[str] = []
        sys.addaudithook(self._audit)
        start = multiprocessing.process.BaseProcess.start

        def guarded_start(process):
            self._refuse(f"a multiprocessing {type(process).__name__}")
            return start(process)

        multiprocessing.process.BaseProcess.start = guarded_start

    def _audit(self, event: str, args: tuple) -> None:
        if event in self.EVENTS:
            program = f" {os.path.basename(str(args[0]))}" if event == "subprocess.Popen" else ""
            self._refuse(event + program)

    def _refuse(self, what: str) -> None:
        if self.armed:
            self.started.append(what)
            raise LaunchRefused(f"make check runs the tests that start no process, and this one started {what}: it "
                                "belongs in THROUGH_LM in tests/inner_loop.py")

    def arm(self) -> None:
        self.started.clear()
        self.armed = True

    def disarm(self) -> None:
        self.armed = False
