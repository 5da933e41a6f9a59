"""The `swift-studio` command line.

Each subcommand is one `add_<name>(parser)` + `cmd_<name>(args) -> int` pair registered in
COMMANDS; adding a subcommand is one function pair and one line in that table. User mistakes
raise `CliError` (one `field: message` line each, naming the file) and exit 1, never a traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import shlex
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

# The job contract (pydantic, YAML) is imported by the commands that read a job: `swift-studio`
# alone binds the studio's port before any of it.
if TYPE_CHECKING:
    from backend.job.cluster import Cluster
    from backend.job.spec import JobSpec, Problem
    from backend.job.validate import Assessment


class CliError(Exception):
    """A user mistake; each problem becomes one line on stderr and the exit code is 1."""

    def __init__(self, problems: list[Problem] | list[str]):
        self.lines = [str(p) for p in problems]
        super().__init__("\n".join(self.lines))


def _in_file(source: str, problems: list[Problem]) -> list[str]:
    """Prefix field problems with the file they come from (file-level ones already name it)."""
    return [str(p) if p.field.startswith(source) else f"{source}: {p}" for p in problems]


def load_job(path: str) -> JobSpec:
    from backend.job.spec import load_spec

    spec, problems = load_spec(path)
    if spec is None:
        raise CliError(_in_file(path, problems))
    return spec


def load_cluster(hostfile: str | None) -> Cluster:
    from backend.job.cluster import HostfileError, local_cluster, parse_hostfile

    if not hostfile:
        return local_cluster()
    try:
        return parse_hostfile(hostfile)
    except HostfileError as exc:
        raise CliError(exc.problems) from None


def checked(spec: JobSpec, cluster: Cluster, source: str) -> Assessment:
    """Assess; raise CliError on errors, print warnings, return the assessment (its problems are
    the warnings) for the plan or the launch."""
    from backend.job.validate import assess, errors

    assessed = assess(spec, cluster)
    warnings = [p for p in assessed.problems if p.severity == "warning"]
    warning_lines = [f"warning: {line}" for line in _in_file(source, warnings)]
    if errors(assessed.problems):
        raise CliError(_in_file(source, errors(assessed.problems)) + warning_lines)
    for line in warning_lines:
        print(line, file=sys.stderr)
    return assessed


def job_and_cluster(args: argparse.Namespace) -> tuple[JobSpec, Cluster, str]:
    """The job named on the command line and the cluster."""
    return load_job(args.job), load_cluster(args.hostfile), args.job


def add_job_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="job YAML")
    parser.add_argument("--hostfile", help="DeepSpeed-style hostfile ('host slots=N [key=value ...]'); default: this machine")


_SLURM_FLAGS = {"partition": "--slurm-partition", "gpus_per_node": "--slurm-gpus-per-node",
                "cpus_per_task": "--slurm-cpus-per-task", "time_limit": "--slurm-time", "account": "--slurm-account",
                "python": "--slurm-python", "nodes": "nnodes"}


def add_slurm_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Slurm", "submit the job to a Slurm partition instead of starting it on "
                                               "--hostfile nodes (one node of the allocation per nnodes)")
    group.add_argument("--slurm-partition", metavar="PARTITION", help="the partition to submit to")
    group.add_argument("--slurm-gpus-per-node", type=int, default=0, metavar="N", help="--gres=gpu:N (0: a CPU job)")
    group.add_argument("--slurm-cpus-per-task", type=int, metavar="N",
                       help="CPUs per node (default: nproc_per_node)")
    group.add_argument("--slurm-time", metavar="TIME", help="time limit (minutes, HH:MM:SS, D-HH:MM:SS)")
    group.add_argument("--slurm-account", metavar="ACCOUNT", help="the account to charge")
    group.add_argument("--slurm-python", default="python3", metavar="PYTHON",
                       help="interpreter on the compute nodes with swift-studio installed (default python3)")
    group.add_argument("--slurm-option", action="append", default=[], metavar="OPTION=VALUE",
                       help="another #SBATCH option, e.g. qos=high (repeatable; scheduling options only)")


def slurm_target(args: argparse.Namespace, spec: JobSpec):
    """The Slurm target the flags describe, or None without --slurm-partition. CliError names
    the flag of each problem."""
    from backend.cluster.slurm import SlurmTarget

    if not getattr(args, "slurm_partition", None):
        return None
    if getattr(args, "hostfile", None):
        raise CliError(["--hostfile, --slurm-partition: give one of them (nodes, or a Slurm partition)"])
    target, problems = SlurmTarget.for_job(spec, args.slurm_partition, args.slurm_gpus_per_node,
                                           args.slurm_cpus_per_task, args.slurm_time, args.slurm_account,
                                           args.slurm_python, args.slurm_option)
    if problems:
        lines = []
        for p in problems:
            name = p.field.removeprefix("slurm.")
            if name.startswith("extra["):
                flag = f"--slurm-option #{int(name[6:-1]) + 1}"
            else:
                flag = _SLURM_FLAGS.get(name, p.field)
            lines.append(f"{flag}: {p.message}")
        raise CliError(lines)
    return target


# -- validate ----------------------------------------------------------------------------------
def add_validate(parser: argparse.ArgumentParser) -> None:
    add_job_args(parser)


def cmd_validate(args: argparse.Namespace) -> int:
    spec, cluster, source = job_and_cluster(args)
    print(f"ok: {checked(spec, cluster, source).layout.summary()}")
    return 0


# -- plan --------------------------------------------------------------------------------------
def add_plan(parser: argparse.ArgumentParser) -> None:
    add_job_args(parser)
    add_slurm_args(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--run-id", help="run id (default: a new YYYYmmdd-HHMMSS-<hex> id)")
    parser.add_argument("--run-dir", help="run directory (default: <output_dir>/<run id>)")
    parser.add_argument("--master-port", type=int, default=None, help="rendezvous port on the first node (default 29500)")
    advice = parser.add_argument_group("layout advisor (--advise): the configurations that fit, fastest predicted first")
    advice.add_argument("--advise", action="store_true", help="rank the job's legal layouts by the cost model "
                                                               "(backend/job/advisor.py) instead of printing its plan")
    advice.add_argument("--gpu-mem-gib", type=float, help="GPU memory (default: the nodes' gpu_mem_gib, else 80)")
    advice.add_argument("--intra-gib-s", type=float, help="bus bandwidth within a node (default 300)")
    advice.add_argument("--inter-gib-s", type=float, help="bus bandwidth between nodes: the pre-flight's figure "
                                                          "(default 20)")
    advice.add_argument("--tokens-per-sample", type=float, help="the data's mean sample length (default max_length)")
    advice.add_argument("--top", type=_positive, default=5, help="rows to show (default 5)")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: give 1 or more")
    return value


def cmd_plan(args: argparse.Namespace) -> int:
    from backend.job.planner import DEFAULT_MASTER_PORT, PlanError, plan
    from backend.runs.manager import make_run_id

    spec, source = load_job(args.job), args.job
    target = slurm_target(args, spec)
    cluster = target.cluster() if target else load_cluster(args.hostfile)
    assessed = checked(spec, cluster, source)
    if args.advise:
        return _advise(args, assessed)
    run_id = args.run_id or make_run_id(None, lambda _: False)
    run_dir = Path(args.run_dir or Path(spec.output_dir) / run_id).expanduser().resolve()
    try:
        result = plan(spec, cluster, run_id, run_dir, master_port=args.master_port or DEFAULT_MASTER_PORT,
                      assessment=assessed)
    except PlanError as exc:
        raise CliError([str(exc)]) from None
    if args.json:
        print(json.dumps({**result.to_dict(), "warnings": [str(w) for w in assessed.problems]}, indent=2))
        return 0
    print(result.summary())
    if target:
        from backend.cluster.slurm import sbatch_script
        try:
            print(f"\n# the batch script (sbatch --parsable {run_dir}/slurm/attempt-1.sbatch)")
            print(sbatch_script(target, result, run_id, attempt=1), end="")
        except ValueError as exc:
            raise CliError([str(exc)]) from None
        return 0
    for node in result.nodes:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in node.env.items())
        print(f"\n# node {node.node_rank}: {node.host}\n{env} {shlex.join(node.argv)}")
    return 0


def _advise(args: argparse.Namespace, assessed: Assessment) -> int:
    from backend.job.advisor import advise, hardware_of

    if assessed.model is None:
        raise CliError([f"model: {assessed.memory_note or 'its config.json cannot be read'}; the advisor needs it"])
    hardware = hardware_of(assessed.cluster, assessed.spec.nnodes, gpu_mem_gib=args.gpu_mem_gib,
                           intra_gib_s=args.intra_gib_s, inter_gib_s=args.inter_gib_s)
    advice = advise(assessed.spec, assessed.model, assessed.cluster, hardware, args.tokens_per_sample, top=args.top)
    if args.json:  # exit 1 where nothing fits, as the text
        print(json.dumps({"hardware": hardware.__dict__, "rows": [r.to_dict() for r in advice.rows],
                          "considered": advice.considered, "refused": advice.refused, "too_big": advice.too_big},
                         indent=2))
        return 0 if advice.rows else 1
    print(advice.summary() + ":")
    if not advice.rows:
        print("no configuration fits: lower max_length or the global batch, or add GPUs")
        return 1
    for rank, row in enumerate(advice.rows, 1):
        print(f"{rank}. {row.engine:<16} {row.layout:<22} predicted {row.memory_gib:6.1f} GiB/GPU "
              f"{row.tokens_per_s:10,.0f} tok/s   {row.changes()}")
    return 0


# -- import ------------------------------------------------------------------------------------
def add_import(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("command", nargs="+", help="an ms-swift command line, quoted: \"swift sft --model ... --deepspeed zero3 ...\"")
    parser.add_argument("-o", "--output", help="write the job YAML here instead of stdout")


def cmd_import(args: argparse.Namespace) -> int:
    from backend.job.msswift import CommandError, import_command

    command = args.command[0] if len(args.command) == 1 else shlex.join(args.command)
    try:
        result = import_command(command)
    except CommandError as exc:
        raise CliError([f"command: {exc}"]) from None
    for line in result.ignored:
        print(f"warning: {line}", file=sys.stderr)
    for line in result.defaults:
        print(f"ms-swift default: {line}", file=sys.stderr)
    spec, problems = result.parse()
    if spec is None:
        raise CliError(problems)
    text = result.yaml_text(spec)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


# -- alerts / metrics (recorded telemetry) -----------------------------------------------------
def add_db_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", help="database URL (default: $SWIFT_STUDIO_DB or the studio's SQLite file)")


def telemetry_engine(args: argparse.Namespace, run_id: str):
    from backend.store.db import DatabaseFileError, default_db_url, make_engine
    from backend.store.telemetry_models import create_telemetry_tables
    from backend.telemetry.export import has_data

    url = args.db or default_db_url()
    try:
        engine = make_engine(url)
        create_telemetry_tables(engine)
    except DatabaseFileError as exc:
        raise CliError([str(exc)]) from None
    if not has_data(engine, run_id):
        raise CliError([f"run: no telemetry recorded for run {run_id!r} in {url}"])
    return engine


def add_alerts(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run id")
    parser.add_argument("--json", action="store_true", help="one JSON object per alert")
    add_db_arg(parser)


def cmd_alerts(args: argparse.Namespace) -> int:
    import time

    from backend.telemetry.query import alerts

    found = alerts(telemetry_engine(args, args.run), args.run)
    for a in found:
        if args.json:
            print(json.dumps(a.model_dump(exclude={"id", "key"})))
            continue
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(a.t))
        again = f" (x{a.count}, last {time.strftime('%H:%M:%S', time.localtime(a.last_t))})" if a.count > 1 else ""
        print(f"{when} {a.severity.upper():7} {a.rule}: {a.message}{again}")
        if a.detail:
            print(f"    {a.detail}")
    if not found and not args.json:
        print(f"no alerts for run {args.run}")
    return 0


def add_metrics(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run id")
    parser.add_argument("--format", choices=("csv", "json", "tensorboard"), default="csv",
                        help="csv or json (stdout unless --out), or tensorboard event files (needs the tensorboard package)")
    parser.add_argument("--out", help="output file (csv/json) or directory (tensorboard)")
    parser.add_argument("--names", nargs="*", help="series to export, e.g. train/loss 'gpu/*' (default: all)")
    add_db_arg(parser)


def cmd_metrics(args: argparse.Namespace) -> int:
    from backend.telemetry.export import ExportError, export

    engine = telemetry_engine(args, args.run)
    try:
        where, n = export(engine, args.run, args.format, Path(args.out) if args.out else None, args.names)
    except ExportError as exc:
        raise CliError([str(exc)]) from None
    if where is not None:
        print(f"wrote {n} values to {where}", file=sys.stderr)
    return 0


# -- studio ------------------------------------------------------------------------------------
def add_studio(parser: argparse.ArgumentParser) -> None:
    from studio.server import add_arguments  # Gradio is imported only when the studio starts

    add_arguments(parser)


def cmd_studio(args: argparse.Namespace) -> int:
    from studio.server import run

    return run(args)


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _runs():
    """backend.runcli (imported as the parser is built). Its module level is light: each of its
    subcommands imports the database and SSH stack when it runs, which `validate`, `plan`, `import`
    and `studio` do not need before they answer."""
    from backend import runcli

    return runcli


COMMANDS = [
    Command("validate", "check a job against the cluster: exit 0 and the layout, or one line per problem", add_validate, cmd_validate),
    Command("plan", "show the per-node torchrun command lines, env, DeepSpeed config and memory estimate", add_plan, cmd_plan),
    Command("import", "turn an ms-swift command line (swift sft / megatron sft / torchrun) into job YAML", add_import, cmd_import),
    Command("alerts", "list a run's alerts (time, severity, rule, message, log line)", add_alerts, cmd_alerts),
    Command("metrics", "export a run's recorded metrics as CSV, JSON or TensorBoard files", add_metrics, cmd_metrics),
    Command("studio", "start the web studio on 127.0.0.1:7860 (what `swift-studio` alone does)", add_studio, cmd_studio),
    Command("preflight", "check every node before a run: SSH, clocks, versions, GPUs, shared storage, ports, bandwidth", lambda p: _runs().add_preflight(p),
            lambda a: _runs().cmd_preflight(a)),
    Command("run", "launch a job on this machine or the hostfile's nodes and follow it (--detach to return)", lambda p: _runs().add_run(p),
            lambda a: _runs().cmd_run(a)),
    Command("runs", "list runs with their state", lambda p: _runs().add_runs(p),
            lambda a: _runs().cmd_runs(a)),
    Command("status", "a run's state, nodes, failure cause and alerts", lambda p: _runs().add_status(p),
            lambda a: _runs().cmd_status(a)),
    Command("logs", "a node's torchrun log of a run (--follow to keep printing)", lambda p: _runs().add_logs(p),
            lambda a: _runs().cmd_logs(a)),
    Command("stop", "stop a run: SIGTERM (checkpoint), SIGKILL after a grace period, verify nothing is left", lambda p: _runs().add_stop(p),
            lambda a: _runs().cmd_stop(a)),
    Command("resume", "resume a stopped or failed run from its latest complete checkpoint", lambda p: _runs().add_resume(p),
            lambda a: _runs().cmd_resume(a)),
    Command("export", "merge and export a run's checkpoint (the worker's export), then a sample generation", lambda p: _runs().add_export(p),
            lambda a: _runs().cmd_export(a)),
    Command("trust-host", "trust a node's SSH host key after checking its fingerprint (recorded)", lambda p: _runs().add_trust_host(p),
            lambda a: _runs().cmd_trust_host(a)),
]


class Parser(argparse.ArgumentParser):
    """argparse with usage mistakes reported like every other user mistake: one line, exit 1."""

    def error(self, message: str):
        raise CliError([f"{self.prog}: {message}"])


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="swift-studio", description="Fine-tune LLMs on one machine or a GPU cluster.")
    sub = parser.add_subparsers(dest="command_name", metavar="COMMAND")
    for command in COMMANDS:
        command.add(sub.add_parser(command.name, help=command.help, description=command.help))
    return parser


# C0 controls but tab and newline, DEL, C1 controls, and the bidirectional overrides and isolates
# that reorder what a line shows ("Trojan Source").
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def escape_controls(text: str) -> str:
    """`text` with every control character written as its Python escape (`\x1b`, `\u202e`):
    a file name, run name or log line cannot clear the terminal, move its cursor or retitle it."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


class _Escaping:
    """A text stream that writes through escape_controls (everything else is the stream's)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        return self._stream.write(escape_controls(text))

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def escaped_output() -> Iterator[None]:
    """Everything a command prints goes through escape_controls: names and log lines come from
    files anyone can write (as `git` and `ls` quote what they print)."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Escaping(sys.stdout), _Escaping(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    with escaped_output():
        try:
            # No command: the studio on 127.0.0.1 with this machine and the demo preset (with the
            # studio's options as given: `swift-studio --port 7871`).
            if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
                argv = ["studio", *argv]
            args = parser.parse_args(argv)
            return {c.name: c.run for c in COMMANDS}[args.command_name](args)
        except CliError as exc:
            for line in exc.lines:
                print(line, file=sys.stderr)
            return 1


if __name__ == "__main__":
    # Under `python -m backend.cli` this module is __main__, and backend.runcli raises the CliError
    # of the imported backend.cli: run that module's main so its except clause catches it.
    from backend.cli import main as _main

    sys.exit(_main())
