"""The Hydra app behind `python pretrain.py [overrides]` and `hrlplan train [overrides]`.

It composes the config and refuses what a user can get wrong before anything starts: every override
(each point of a sweep) is composed and checked first, so a typo or a value out of range is one line
(`hrlplan: error: ...`, exit 2) naming the key, the value and what is allowed, never a traceback.
Then hrlplan.launch.job runs probe -> plan -> train. Living in the package (not in pretrain.py) lets
an installed hrlplan run it from any directory and lets submitit pickle the task by its module name.
"""
import atexit
import os
import re
import sys
import warnings

import hydra
from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from hrlplan.compose import compose, normalize_overrides, register_configs, to_plain
from hrlplan.config import typed
from hrlplan.errors import ConfigError, UserError
from hrlplan.launch.resume_run import resumed_overrides, say_once, write_record
from hrlplan.launch.rundir import RunDirLock, check_output_dir, note, takes_lock
from hrlplan.conf_tree import conf_dir
from hrlplan.validate import check_environment, precheck_overrides
from hrlplan.validate.environ import reports_errors

register_configs()
# conf/hydra/launcher/submitit_*.yaml share names with the plugin's own schemas, which Hydra 1.3
# reports as a deprecation; the plugin's schema still validates them.
warnings.filterwarnings("ignore", message=r"(?s).*validated against ConfigStore schema", category=UserWarning)


def _refuse(error: Exception) -> None:
    # Under torchrun every rank checks and rank 0 says it; a process no launcher started says it itself.
    if reports_errors(os.environ):
        print(f"hrlplan: error: {error}", file=sys.stderr, flush=True)
    sys.exit(2)


def precheck(argv):
    """Compose the command line's overrides (each sweep value) before Hydra runs anything."""
    argv = normalize_overrides(argv)
    args, _ = get_args_parser().parse_known_args(argv)
    modes = [flag for flag, on in (("--run", args.run), ("--multirun", args.multirun), ("--cfg", args.cfg),
                                   ("--info", args.info), ("--shell-completion", args.shell_completion)) if on]
    if len(modes) > 1:   # Hydra says so in a traceback
        _refuse(ConfigError("command line", message=f"{' and '.join(modes)} cannot be combined: use one of them"))
    own_config = args.config_name or args.config_path or args.config_dir
    if args.help or args.hydra_help or args.info or args.shell_completion or own_config:
        return argv
    overrides = [o for o in args.overrides if not o.lstrip("+~").startswith("hydra")]
    hydra_overrides = [o for o in args.overrides if o.lstrip("+~").startswith("hydra")]
    try:
        _check_output_dirs(hydra_overrides, args.multirun)
        if not args.multirun:   # a sweep's points resume from their own directories, as given
            restored = resumed_overrides(overrides, hydra_overrides, compose, say_once)
            if restored != overrides:
                argv, overrides = _with_task_overrides(argv, set(overrides), restored), restored
        searchpath = [o for o in hydra_overrides if o.lstrip("+~").startswith("hydra.searchpath=")]
        precheck_overrides(overrides + searchpath, compose, multirun=args.multirun)
    except ConfigError as e:
        _refuse(e)
    return argv


def _check_output_dirs(hydra_overrides, multirun: bool) -> None:
    """hydra.run.dir (hydra.sweep.dir for -m) as the command line gives it: refused before Hydra creates it."""
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    given = [o for o in hydra_overrides if o.lstrip("+~").split("=", 1)[0] == key and "=" in o]
    if given:
        check_output_dir(key, OverridesParser.create().parse_overrides(given[-1:])[0].value())


def _with_task_overrides(argv, old, new):
    """argv with its task overrides replaced by `new` (flags and hydra.* overrides kept, in place)."""
    return [a for a in argv if a not in old] + list(new)


# $HRLPLAN_CONF (a copy of conf/ to edit) is honoured here as by the hrlplan commands and compose();
# otherwise the tree shipped in the package (hrlplan/conf, a link to the checkout's conf/).
def _config_path() -> str:
    try:
        return str(conf_dir())   # absolute: Hydra would read a relative one as the module hrlplan.conf
    except UserError:
        return os.environ.get("HRLPLAN_CONF") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf")


@hydra.main(version_base="1.3", config_path=_config_path(), config_name="config")
def main(cfg: DictConfig):
    # why here: the launcher brings torch; `--help`, `--cfg` and tab completion never need it
    from hrlplan.launch.job import run_from_hydra
    from hrlplan.launch.local import in_distributed_job
    from hrlplan.launch.slurm import in_srun_task, in_submitit_task

    submitit = in_submitit_task() or bool(os.environ.get("SUBMITIT_EXECUTOR"))
    hydra_config = HydraConfig.get()
    lock = None
    try:
        plain = to_plain(cfg, hydra_config.overrides.task)
        if plain.get("run_dir"):
            check_output_dir("run_dir", plain["run_dir"])
        # Inside torchrun or a SLURM task the world size is the launcher's; paths are still ours to check.
        check_environment(plain, launching=not (in_distributed_job() or submitit or in_srun_task()))
        run_dir = plain.get("run_dir") or hydra_config.runtime.output_dir
        lock = _claim(run_dir, plain, hydra_config)
    except UserError as e:
        if submitit:
            raise  # submitit records it as the job's error
        _refuse(e)
    if not in_distributed_job() and not submitit:
        print(f"[hrlplan] output directory: {run_dir}", file=sys.stderr, flush=True)
    try:
        return run_from_hydra(typed(plain))  # the submitit launcher hands rank 0's summary back to the sweep
    finally:
        if lock is not None:
            lock.release()


def _claim(run_dir: str, plain, hydra_config) -> "RunDirLock | None":
    """One process per job locks the run directory (a second job there is refused) and records the
    run's config there, which a resume restores (hrlplan/launch/resume_run.py)."""
    if not takes_lock():
        return None
    key = "run_dir" if plain.get("run_dir") else (
        "hydra.sweep.dir" if hydra_config.mode == RunMode.MULTIRUN else "hydra.run.dir")
    lock = RunDirLock(run_dir, key)
    taken_over = lock.acquire()
    atexit.register(lock.release)   # whatever ends this process; main's finally ends a sweep's job
    if taken_over:
        note(taken_over)
    write_record(run_dir, hydra_config.overrides.task, plain)
    return lock


def _completion_line() -> None:
    """Hydra's completion drops the first word of the command line (`hrlplan`, or `python pretrain.py`):
    for `hrlplan train <TAB>` the subcommand goes too, or Hydra would read `train` as an override."""
    line = os.environ.get("COMP_LINE")
    if line is not None:
        os.environ["COMP_LINE"] = re.sub(r"^(\s*\S*hrlplan)\s+train(\s|$)", r"\1\2", line)


def run(argv=None) -> None:
    """`python pretrain.py [overrides]` and `hrlplan train [overrides]`: check every override, then run."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-sc", "--shell-completion") or a.startswith("--shell-completion=") for a in argv):
        _completion_line()
    sys.argv = [sys.argv[0], *precheck(argv)]
    main()
