"""`lm slurm submit`: render an sbatch script for a training run (or an array of runs from a sweep file, or an
evaluation), write it into the run directory, submit it and print the job id.

    lm slurm submit [SLURM options] -- [lm train arguments]
    lm slurm submit [SLURM options] --array SWEEP.yaml [-- arguments common to every run]
    lm slurm submit --kind eval [SLURM options] -- ppl --checkpoint RUN_DIR ...
    lm slurm submit --kind eval --tasks N [SLURM options] -- mqar-grid --out DIR ...   # task i adds --cell i
    lm slurm submit --kind prepare --tasks N [SLURM options] -- --inputs ... --out DIR ...   # then a merge job

The run's resolved config is frozen into RUN_DIR/slurm/ at submission, so a requeued job trains exactly what was
submitted. Site defaults (partition, account, setup lines) come from the site file, never from the code.
"""

import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import yaml
from jsonargparse import ArgumentParser

from lm.slurm import scheduler
from lm.util.config_errors import error_line, load_yaml
from lm.util.errors import UserError
from lm.util.resources import shipped

SITE_FILE_DEFAULT = "~/.config/lm/slurm.yaml"
TEMPLATE = shipped("slurm/templates/job.sbatch.j2")


@dataclass
class SlurmOptions:
    """A job's resources and the site's settings (defaults: the site file, then the command line).

    The site file is $LM_SLURM_SITE, else ~/.config/lm/slurm.yaml (see slurm/site.example.yaml).

    Args:
        nodes: Nodes (default: the run's strategy.num_nodes).
        gpus_per_node: GPUs per node, one process each (default: the run's strategy.devices; 0 for a CPU job).
        cpus_per_task: CPUs per process.
        mem: Memory per node, as sbatch takes it ("0" for all of it, "64G").
        time: Time limit, as sbatch takes it ("24:00:00").
        partition: Partition.
        account: Account to charge.
        qos: Quality of service.
        constraint: Node features required.
        exclusive: Whole nodes only.
        signal_seconds: SIGUSR1 this long before the time limit, so the run checkpoints and requeues itself.
        setup: Shell lines run first in the job (module loads, venv activation).
        python: The job's Python interpreter (default: the one running this command).
        sbatch: Further sbatch options, one per item ("--mail-type=END").
    """

    nodes: int | None = None
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    signal_seconds: int = 300
    setup: list[str] = field(default_factory=list)
    python: str | None = None
    sbatch: list[str] = field(default_factory=list)

    def __post_init__(self):
        for name, least in (("nodes", 1), ("gpus_per_node", 0), ("cpus_per_task", 1), ("signal_seconds", 0)):
            value = getattr(self, name)
            if value is not None and value < least:
                raise UserError(f"--{name} must be at least {least}, got {value}")


@dataclass
class PlannedRun:
    run_dir: Path
    args: list[str]  # the `lm` command line the job runs
    frozen: tuple[Path, str] | None = None  # (path, resolved config) written at submission
    shape: tuple[int, int, int] = (1, 1, 0)  # nodes, processes per node, GPUs per node


def site_file() -> Path:
    if "LM_SLURM_SITE" in os.environ:
        path = Path(os.environ["LM_SLURM_SITE"]).expanduser()
        if not path.is_file():
            raise UserError(f"LM_SLURM_SITE names {path}, which is not a file")
        return path
    return Path(SITE_FILE_DEFAULT).expanduser()


def submit_parser() -> ArgumentParser:
    site = site_file()
    parser = ArgumentParser(prog="lm slurm submit", exit_on_error=False, default_env=False, allow_abbrev=False,
                            default_config_files=[str(site)] if site.is_file() else [],
                            description="Submit a training run, a sweep or an evaluation to SLURM. Defaults "
                                        "come from the site file: $LM_SLURM_SITE, else ~/.config/lm/slurm.yaml "
                                        "(see slurm/site.example.yaml); the command line overrides them.")
    parser.add_argument("--kind", choices=["train", "eval", "prepare"], default="train",
                        help="train: `lm train` on nodes x devices; eval: an `lm eval` command, one process; prepare: "
                             "`lm prepare` as an array of --tasks parts and a merge job.")
    parser.add_argument("--array", type=str | None, default=None,
                        help="A sweep file (runs: a list of config-key mappings): one array task per run.")
    parser.add_argument("--tasks", type=int | None, default=None,
                        help="--kind eval: an array of N tasks, task i running the command with `--cell i` (a grid "
                             "split into cells, e.g. mqar-grid; `lm eval mqar-grid ... --cell -1` prints N). --kind "
                             "prepare: plan here, then an array of N tasks (`--task i`) and a merge job after them.")
    parser.add_argument("--job_dir", type=str | None, default=None,
                        help="Where the script and the job's own log go (default: RUN_DIR/slurm; a sweep: "
                             "runs/sweeps/NAME; an evaluation: the checkpoint's run directory/slurm; prepare: "
                             "OUT/slurm).")
    parser.add_argument("--dry_run", type=bool, default=False,
                        help="Print the script and write what it needs (the frozen config, the log folder), so that "
                             "`sbatch SCRIPT` submits it as printed; submit nothing.")
    parser.add_class_arguments(SlurmOptions, nested_key=None)
    return parser


FLAGS = ("--dry_run", "--exclusive")  # switches: given alone, they mean true


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """Own options and the command after `--`."""
    cut = argv.index("--") if "--" in argv else len(argv)
    own = argv[:cut]
    # A switch followed by a value (`--dry_run true`, the form --help shows) takes it; given alone, it means true.
    valued = {i for i, arg in enumerate(own[:-1]) if normalised(arg, False) in FLAGS and not own[i + 1].startswith("-")}
    own = [f"{normalised(arg, False)}={own[i + 1]}" if i in valued else normalised(arg)
           for i, arg in enumerate(own) if i - 1 not in valued]
    return own, argv[cut + 1:]


def normalised(arg: str, alone: bool = True) -> str:
    """--dry-run -> --dry_run=true: jsonargparse's option names are the fields' names, and its booleans take a
    value (a switch `alone`, with no value after it, means true)."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg[2:].partition("=")
    arg = "--" + name.replace("-", "_") + eq + value
    return arg + "=true" if alone and arg in FLAGS else arg


def sweep_runs(path: str) -> list[list[str]]:
    """The `lm train` arguments of each run of a sweep file:

        common: {config: configs/demo.yaml, trainer.max_steps: 200}   # optional, every run
        runs:
          - {model.mixer: attention, run_dir: runs/sweep/attention}
          - {model.mixer: mamba2, run_dir: runs/sweep/mamba2}
    """
    if not Path(path).is_file():
        raise UserError(f"sweep file {path} not found")
    sweep = load_yaml(path) or {}  # a syntax error: "FILE, line N: what"
    runs = sweep.get("runs") if isinstance(sweep, dict) else None
    if not runs or not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
        raise UserError(f"sweep file {path} needs `runs:`, a list of mappings of config keys to values")
    unknown = set(sweep) - {"common", "runs"}
    if unknown:
        raise UserError(f"sweep file {path}: unknown key(s) {', '.join(sorted(unknown))} (common, runs)")
    return [as_arguments({**(sweep.get("common") or {}), **run}) for run in runs]


def as_arguments(settings: dict) -> list[str]:
    args = []
    for key, value in settings.items():
        for item in (value if key == "config" and isinstance(value, list) else [value]):
            args += [f"--{key}", item if isinstance(item, str) else yaml.safe_dump(item, default_flow_style=True)
                     .strip().removesuffix("\n...")]
    return args


def plan_train(args: list[str], opts: SlurmOptions, stamp: str) -> PlannedRun:
    """Check the run's arguments as `lm train` would, fix its shape from the options, freeze its config."""
    from lm.training.config import parse_run_config

    config, resume, _ = parse_run_config(args)
    st = config.strategy
    nodes = opts.nodes or st.num_nodes
    if st.accelerator == "cpu":
        if opts.gpus_per_node:
            raise UserError("--gpus_per_node with strategy.accelerator cpu: drop one of them")
        devices, gpus = st.devices, 0
    else:
        devices = gpus = opts.gpus_per_node if opts.gpus_per_node is not None else st.devices
    if not isinstance(devices, int) or devices < 1:
        raise UserError(f"a SLURM job needs a number of processes per node: set --gpus_per_node or "
                        f"strategy.devices (now {devices!r})")
    run_dir = Path(config.run_dir).resolve()
    _, _, resolved = parse_run_config(args + ["--strategy.num_nodes", str(nodes), "--strategy.devices",
                                              str(devices), "--run_dir", str(run_dir)])
    frozen = run_dir / "slurm" / f"train-{stamp}.yaml"
    return PlannedRun(run_dir, ["train", "--config", str(frozen), "--resume", resume],
                      (frozen, resolved), (nodes, devices, gpus))


def plan_eval(command: list[str], opts: SlurmOptions, job_dir: str | None, tasks: int | None = None) -> PlannedRun:
    """An `lm eval` command, checked as the CLI would parse it; one process (per array task with `tasks`)."""
    from lm.training.checkpoint import run_dir_of
    from lm.util.commands import COMMANDS, function_parser, load_command

    evals = [c.split()[1] for c in COMMANDS if c.startswith("eval ")]
    if not command or command[0] not in evals:
        raise UserError(f"--kind eval needs an eval command after `--`: one of {', '.join(evals)}")
    name = f"eval {command[0]}"
    parser = function_parser(load_command(name), f"lm {name}")
    try:
        namespace = parser.parse_args(command[1:])
    except Exception as err:
        raise UserError(error_line(parser, err)) from None
    if tasks is not None:
        if "cell" not in namespace:
            raise UserError(f"--tasks needs a command split into cells (a --cell option); lm {name} has none")
        if namespace.get("cell") is not None:
            raise UserError("--tasks gives each array task its --cell: drop --cell from the command")
        if tasks < 1:
            raise UserError(f"--tasks must be at least 1, got {tasks}")
    checkpoint, out = namespace.get("checkpoint"), namespace.get("out")
    if job_dir is None and checkpoint is None and out is None:
        raise UserError(f"lm {name} has no --checkpoint: give --job_dir for the job's script and log")
    # The job's script and log go beside what it evaluates, else beside what it writes.
    run_dir = (run_dir_of(checkpoint) if checkpoint else Path(job_dir or out)).resolve()
    gpus = opts.gpus_per_node if opts.gpus_per_node is not None else 1
    return PlannedRun(run_dir, ["eval", *command], None, (1, 1, gpus))


def plan_prepare(command: list[str], opts: SlurmOptions, tasks: int | None) -> tuple[PlannedRun, dict]:
    """An `lm prepare` command, checked as the CLI would parse it, as an array of `tasks` parts; and its arguments
    for prepare() (the plan step, run here at submission)."""
    from lm.util.commands import function_parser, load_command

    if tasks is None or tasks < 1:
        raise UserError(f"--kind prepare needs --tasks N (at least 1), got {tasks}")
    parser = function_parser(load_command("prepare"), "lm prepare")
    try:
        namespace = parser.parse_args(command)
    except Exception as err:
        raise UserError(error_line(parser, err)) from None
    given = [f"--{key}" for key in ("tasks", "task", "merge") if namespace.get(key) not in (None, False)]
    if given:
        raise UserError(f"drop {', '.join(given)} from the lm prepare command: --tasks N of lm slurm submit sets them")
    namespace.pop("config", None)
    gpus = opts.gpus_per_node or 0
    run = PlannedRun(Path(namespace["out"]).resolve(), ["prepare", *command, "--tasks", str(tasks)], None, (1, 1, gpus))
    return run, {**namespace.as_dict(), "tasks": tasks}


def submit_prepare(run: PlannedRun, arguments: dict, opts: SlurmOptions, job_dir: Path, tasks: int, stamp: str,
                   dry_run: bool) -> str | None:
    """The plan step here, then the array of parts and the merge job that waits for all of them (afterok)."""
    name = f"lm-prepare-{run.run_dir.name}"
    merge = PlannedRun(run.run_dir, [*run.args, "--merge", "true"], None, run.shape)
    scripts = {"prepare": render("prepare", [run], opts, job_dir, False, name, tasks),
               "merge": render("prepare", [merge], opts, job_dir, False, f"{name}-merge")}
    if dry_run:  # the log folder only: the plan step (and its tokenizer) is real work, done at submission
        job_dir.mkdir(parents=True, exist_ok=True)
        print("\n".join(scripts.values()), end="")
        print(f"lm slurm submit: dry run: nothing submitted; wrote {job_dir} for the scripts above (each says how to "
              f"submit it)", file=sys.stderr)
        return None
    scheduler.require("sbatch")
    from lm.data_prep.prepare import prepare

    if "shares" not in prepare(**arguments):  # the dataset is there already: nothing to submit
        print(f"{run.run_dir} is prepared already: nothing submitted", file=sys.stderr)
        return None
    job_dir.mkdir(parents=True, exist_ok=True)
    (run.run_dir / "slurm").mkdir(parents=True, exist_ok=True)
    job_id = None
    for kind, script in scripts.items():
        path = job_dir / f"{kind}-{stamp}.sbatch"
        path.write_text(script)
        job_id = scheduler.sbatch(path, dependency=f"afterok:{job_id}" if job_id else None)
        scheduler.record_job(run.run_dir, job_id, kind, path)
        print(job_id)
    return job_id


def refuse_live_jobs(run_dirs: list[Path]) -> None:
    """Two live jobs training one run directory would interleave their checkpoints."""
    for run_dir in run_dirs:
        for job in scheduler.recorded_jobs(run_dir):
            info = scheduler.job_info(job["job"]) if job["kind"] == "train" else None
            if scheduler.is_live(info):
                raise UserError(f"run_dir {run_dir} is already being trained by live job {job['job']} "
                                f"({info['JobState']}): scancel it, wait for it, or use another run_dir")


def write_what_the_script_needs(runs: list[PlannedRun], job_dir: Path) -> list[Path]:
    """Each run's frozen config and slurm/ folder (an array task's log goes there), and the job's log folder: made at
    submission, and by a dry run, whose printed script is then submitted as it is. What was written."""
    written = []
    for run in runs:
        (run.run_dir / "slurm").mkdir(parents=True, exist_ok=True)
        if run.frozen:
            run.frozen[0].write_text(run.frozen[1])
            written.append(run.frozen[0])
    job_dir.mkdir(parents=True, exist_ok=True)
    return [*written, job_dir]


def render(kind: str, runs: list[PlannedRun], opts: SlurmOptions, job_dir: Path, array: bool,
           job_name: str, tasks: int | None = None) -> str:
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined)
    env.filters["quote"] = lambda s: shlex.quote(str(s))
    env.filters["quote_all"] = lambda args: " ".join(shlex.quote(str(a)) for a in args)
    nodes, tasks_per_node, gpus = runs[0].shape
    return env.from_string(TEMPLATE.read_text()).render(
        kind=kind, runs=runs, o=opts, array=array, tasks=tasks, job_name=job_name, nodes=nodes,
        task_option="--task" if kind == "prepare" else "--cell",  # what each array task adds: its index
        tasks_per_node=tasks_per_node, gpus_per_node=gpus, chdir=os.getcwd(), job_dir=job_dir, requeue=kind == "train",
        log_name="array-%A_%a" if array or tasks else "job-%j", python=opts.python or sys.executable)


def submit_from_args(argv: list[str]) -> str | None:
    """`lm slurm submit`; prints and returns the job id (None for --dry_run; --kind prepare prints the array's and
    returns the merge job's)."""
    own, command = split_argv(argv)
    parser = submit_parser()
    try:
        namespace = parser.parse_args(own)
    except Exception as err:
        raise UserError(error_line(parser, err)) from None
    kind, array, tasks, job_dir, dry_run = (namespace.pop(k) for k in ("kind", "array", "tasks", "job_dir",
                                                                        "dry_run"))
    namespace.pop("__default_config__", None)
    opts = SlurmOptions(**{k: v for k, v in namespace.as_dict().items() if k in SlurmOptions.__annotations__})
    stamp = time.strftime("%Y%m%d-%H%M%S")

    if tasks is not None and kind == "train":
        raise UserError("--tasks is for --kind eval (a grid split into cells) or prepare; a training sweep is --array")
    if kind == "prepare":
        if array:
            raise UserError("--array is for training sweeps; lm prepare's array is --tasks N")
        run, arguments = plan_prepare(command, opts, tasks)
        job_dir = Path(job_dir).resolve() if job_dir else run.run_dir / "slurm"
        return submit_prepare(run, arguments, opts, job_dir, tasks, stamp, dry_run)
    if kind == "eval":
        if array:
            raise UserError("--array is for training sweeps; an evaluation grid is --tasks N")
        runs = [plan_eval(command, opts, job_dir, tasks)]
        job_dir = Path(job_dir).resolve() if job_dir else runs[0].run_dir / "slurm"
        job_name = f"lm-eval-{runs[0].run_dir.name}"
    elif array:
        runs = [plan_train(args + command, opts, stamp) for args in sweep_runs(array)]
        dirs = [r.run_dir for r in runs]
        if len(set(dirs)) < len(dirs):
            raise UserError(f"sweep file {array}: two runs share a run_dir; give each run its own")
        if len({r.shape for r in runs}) > 1:
            raise UserError(f"sweep file {array}: an array job has one shape, but its runs differ in nodes x "
                            f"devices {sorted({r.shape[:2] for r in runs})}")
        job_dir = Path(job_dir or Path("runs/sweeps") / Path(array).stem).resolve()
        job_name = f"lm-sweep-{Path(array).stem}"
    else:
        if not command:
            raise UserError("nothing to run: put the lm train arguments after `--` "
                            "(lm slurm submit [options] -- --config CONFIG.yaml ...)")
        runs = [plan_train(command, opts, stamp)]
        job_dir = Path(job_dir).resolve() if job_dir else runs[0].run_dir / "slurm"
        job_name = f"lm-{runs[0].run_dir.name}"

    script = render(kind, runs, opts, job_dir, bool(array), job_name, tasks)
    if not dry_run:
        if kind == "train":
            refuse_live_jobs([r.run_dir for r in runs])
        scheduler.require("sbatch")
    written = write_what_the_script_needs(runs, job_dir)
    if dry_run:  # the script, as printed, can be submitted with sbatch: what it points at is there
        print(script, end="")
        print(f"lm slurm submit: dry run: nothing submitted; wrote {', '.join(map(str, written))} for the script "
              f"above (submit it with sbatch as it is)", file=sys.stderr)
        return None
    path = job_dir / f"{kind}-{stamp}.sbatch"
    path.write_text(script)
    job_id = scheduler.sbatch(path)
    for i, run in enumerate(runs):
        scheduler.record_job(run.run_dir, f"{job_id}_{i}" if array else job_id, kind, path)
    print(job_id)
    return job_id
