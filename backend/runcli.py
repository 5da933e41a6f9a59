"""CLI subcommands of the cluster backend (registered in `backend.cli.COMMANDS`):

    swift-studio preflight [JOB.yaml] [--hostfile F] [--no-bandwidth]
    swift-studio run JOB.yaml [--hostfile F | --slurm-partition P [--slurm-...]] [--name N] [--detach]
    swift-studio runs
    swift-studio status RUN
    swift-studio logs RUN [--node H] [--lines N] [--follow]
    swift-studio stop RUN
    swift-studio resume RUN [--hostfile F]
    swift-studio export RUN [--checkpoint STEP|PATH] [--out DIR]
    swift-studio trust-host HOST [--hostfile F] [--fingerprint SHA256:...]

Node setup lines come from the node inventory in the database (the studio's Cluster tab).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime

# backend.cli imports this module lazily, when one of these subcommands runs.
from backend.cli import CliError, add_db_arg, add_slurm_args, checked, load_cluster, load_job, slurm_target
from backend.runs.usage import format_duration


def _manager(args: argparse.Namespace, reattach: bool = True):
    from backend.runs.manager import RunManager
    from backend.store.db import DatabaseFileError
    try:
        return RunManager(args.db, reattach=reattach)
    except DatabaseFileError as exc:
        raise CliError([str(exc)]) from None


def _add_db(parser: argparse.ArgumentParser) -> None:
    add_db_arg(parser)
    parser.epilog = "Host keys are checked against $SWIFT_STUDIO_KNOWN_HOSTS or ~/.ssh/known_hosts."


@contextmanager
def _refused(*also: type[Exception]) -> Iterator[None]:
    """Errors the user fixes (unknown run, wrong state, and `also`, e.g. an unreachable host): a message, no traceback."""
    from backend.runs.manager import RunError
    try:
        yield
    except (RunError, *also) as exc:
        raise CliError([str(exc)]) from None


def _when(t: float | None) -> str:
    return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S") if t else "-"


def _progress(progress: dict | None) -> str:
    """`step 12/200, loss 1.234, 456 tokens/s, ETA 1m 30s` from RunManager.progress (what it has)."""
    if not progress or progress.get("step") is None:
        return ""
    parts = [f"step {progress['step']}" + (f"/{progress['max_steps']}" if progress.get("max_steps") else "")]
    if isinstance(progress.get("loss"), (int, float)):
        parts.append(f"loss {progress['loss']:.4g}")
    if isinstance(progress.get("tokens_per_s"), (int, float)):
        parts.append(f"{progress['tokens_per_s']:.0f} tokens/s")
    if isinstance(progress.get("eta_s"), (int, float)):
        parts.append(f"ETA {format_duration(progress['eta_s'])}")
    return ", ".join(parts)


def _describe(run) -> list[str]:
    from backend.runs import lifecycle

    lines = [f"{run.id}: {run.state} (attempt {run.attempts}, created {_when(run.created_at)}, run dir {run.run_dir})"]
    if run.state == lifecycle.FAILED or run.message:
        lines.append(f"  {run.message or run.cause}")
        if run.log_tail:
            lines += ["  last log lines:", *("    " + ln for ln in run.log_tail.splitlines()[-10:])]
    return lines


# -- preflight ---------------------------------------------------------------------------------
def add_preflight(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", nargs="?", help="job YAML (for nnodes, nproc_per_node, output_dir, env)")
    parser.add_argument("--hostfile", help="hostfile; default: this machine")
    parser.add_argument("--no-bandwidth", action="store_true", help="skip the all-reduce bandwidth test")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    _add_db(parser)


def cmd_preflight(args: argparse.Namespace) -> int:
    spec = load_job(args.job) if args.job else None
    cluster = load_cluster(args.hostfile)
    with _manager(args, reattach=False) as m:
        report = m.preflight(cluster, spec, bandwidth=not args.no_bandwidth)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.text())
    return 0 if report.ok else 1


# -- run ---------------------------------------------------------------------------------------
def add_run(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="job YAML")
    parser.add_argument("--hostfile", help="hostfile; default: this machine")
    parser.add_argument("--name", help="run name (default: a time-stamped id)")
    parser.add_argument("--detach", action="store_true", help="return once the workers run; they keep running")
    add_slurm_args(parser)
    _add_db(parser)


def cmd_run(args: argparse.Namespace) -> int:
    from backend.runs import lifecycle

    spec = load_job(args.job)
    target = slurm_target(args, spec)
    cluster = target.cluster() if target else load_cluster(args.hostfile)
    assessed = checked(spec, cluster, args.job)
    with _manager(args) as m:
        run_id = m.launch(spec, cluster, name=args.name, assessment=assessed, slurm=target)
        print(f"run {run_id}: {m.run(run_id).run_dir}", flush=True)
        run = m.wait(run_id, states=(lifecycle.RUNNING, *lifecycle.FINAL))
        if args.detach or run.state in lifecycle.FINAL:
            for line in _describe(run):
                print(line)
            if run.state == lifecycle.RUNNING:
                print(f"detached; follow with: swift-studio logs {run_id} --follow")
            return 0 if run.state in (lifecycle.RUNNING, lifecycle.SUCCEEDED) else 1
        print(f"running on {', '.join(m.nodes_of(run_id))}; Ctrl-C leaves it running", flush=True)
        return _follow(m, run_id)


def _follow(m, run_id: str) -> int:
    """Print the first node's log (each attempt starts its own) as it grows until the run ends,
    then how it ended."""
    from backend.runs import lifecycle

    offset = 0
    try:
        while True:
            text, offset = m.log_since(run_id, None, offset)
            sys.stdout.write(text)
            sys.stdout.flush()
            run = m.run(run_id)
            if run.state in lifecycle.FINAL:
                break
            time.sleep(1.0)
    except KeyboardInterrupt:
        print(f"\nleft running; stop it with: swift-studio stop {run_id}")
        return 130
    for line in _describe(run):
        print(line)
    return 0 if run.state == lifecycle.SUCCEEDED else 1


# -- runs / status -----------------------------------------------------------------------------
def add_runs(parser: argparse.ArgumentParser) -> None:
    _add_db(parser)


def cmd_runs(args: argparse.Namespace) -> int:
    from backend.runs import lifecycle

    with _manager(args) as m:
        for run in m.runs():
            if run.state in lifecycle.ACTIVE:
                m.settle(run.id)
        runs = [(run, m.progress(run.id)) for run in m.runs()]
    if not runs:
        print("no runs yet")
    now = time.time()
    for run, progress in runs:
        step = (progress or {}).get("step")
        loss = (progress or {}).get("loss")
        print(f"{run.id:<32} {run.state:<10} attempt {run.attempts}  {_when(run.created_at)}  "
              f"{format_duration((run.ended_at or now) - run.created_at):>7}  "
              f"{'step ' + str(step) if step is not None else '':<10} "
              f"{f'loss {loss:.4g}' if isinstance(loss, (int, float)) else '':<12} "
              f"{(run.cause or '') if run.state == lifecycle.FAILED else ''}".rstrip())
    return 0


def add_status(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run id")
    _add_db(parser)


def cmd_status(args: argparse.Namespace) -> int:
    from backend.runs.lifecycle import attempt_history

    with _manager(args) as m, _refused():
        run = m.settle(args.run)
        lines = _describe(run)
        if progress := _progress(m.progress(args.run)):
            lines.insert(1, f"  {progress}")
        attempts = m.attempts(args.run)
        if len(attempts) > 1:
            for line, message in attempt_history(attempts):
                lines += ["  " + line, *(["      " + message] if message else [])]
        for p in m.processes(args.run):
            lines.append(f"  node {p.node}: {p.state}"
                         + (f", process group {p.pgid}" if p.pgid is not None else "")
                         + (f", exit code {p.exit_code}" if p.exit_code is not None else "")
                         + (f", no answer for {time.time() - p.unreachable_since:.0f} s"
                            if p.state == "unreachable" and p.unreachable_since else ""))
        lines += [f"  notice {notice}" for notice in m.notices(args.run, last=10)]
        for alert in m.alerts(args.run):
            lines.append(f"  alert [{alert.severity}] {alert.message}")
    print("\n".join(lines))
    return 0


# -- logs --------------------------------------------------------------------------------------
def add_logs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run id")
    parser.add_argument("--node", help="node host (default: the first node)")
    parser.add_argument("--lines", type=int, default=50, help="lines to show (default 50)")
    parser.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until the run ends")
    _add_db(parser)


def cmd_logs(args: argparse.Namespace) -> int:
    from backend.runs import lifecycle

    with _manager(args, reattach=args.follow) as m, _refused():
        try:
            for line in m.log_tail(args.run, args.node, args.lines):
                print(line)
            if not args.follow:
                return 0
            _, offset = m.log_since(args.run, args.node, 0)
            while m.run(args.run).state not in lifecycle.FINAL:
                time.sleep(1.0)
                text, offset = m.log_since(args.run, args.node, offset)
                sys.stdout.write(text)
                sys.stdout.flush()
        except KeyboardInterrupt:
            return 130
    return 0


# -- stop / resume / export --------------------------------------------------------------------
def add_stop(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run id")
    _add_db(parser)


def cmd_stop(args: argparse.Namespace) -> int:
    from backend.runs import lifecycle

    with _manager(args, reattach=False) as m, _refused():
        run = m.stop(args.run)
    for line in _describe(run):
        print(line)
    return 0 if run.state in lifecycle.FINAL else 1


def add_resume(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run id")
    parser.add_argument("--hostfile", help="resume on these nodes instead of the previous ones")
    parser.add_argument("--detach", action="store_true", help="return once the workers run")
    parser.add_argument("--from-scratch", action="store_true",
                        help="start again from step 0 (where the run's checkpoints are gone)")
    _add_db(parser)


def cmd_resume(args: argparse.Namespace) -> int:
    from backend.runs import lifecycle

    cluster = load_cluster(args.hostfile) if args.hostfile else None
    with _manager(args) as m:
        with _refused():
            m.resume(args.run, cluster, from_scratch=args.from_scratch)
        run = m.wait(args.run, states=(lifecycle.RUNNING, *lifecycle.FINAL))
        if not args.detach and run.state == lifecycle.RUNNING:
            print(f"resumed {args.run} (attempt {run.attempts}) on {', '.join(m.nodes_of(args.run))}; "
                  "Ctrl-C leaves it running", flush=True)
            return _follow(m, args.run)
    for line in _describe(run):
        print(line)
    return 0 if run.state in (lifecycle.RUNNING, lifecycle.SUCCEEDED) else 1


def add_export(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run id")
    parser.add_argument("--checkpoint", help="checkpoint step or directory (default: the latest complete one)")
    parser.add_argument("--out", help="output directory (default: <run dir>/export)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON (for scripts)")
    _add_db(parser)


def cmd_export(args: argparse.Namespace) -> int:
    with _manager(args, reattach=False) as m, _refused():
        result = m.export(args.run, args.checkpoint, args.out)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    merged = "LoRA merged, " if result.get("lora_merged") else ""
    print(f"exported {result['checkpoint']} to {result['out']} (safetensors, {merged}with its tokenizer)")
    for skipped in result.get("skipped") or []:
        print(f"  passed over a damaged checkpoint: {skipped}")
    if result.get("prompt") is not None:
        print(f"  sample prompt: {result['prompt']}")
        print(f"  its answer:    {result.get('sample')}")
    return 0


# -- trust-host --------------------------------------------------------------------------------
def add_trust_host(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("host", help="host as named in the hostfile")
    parser.add_argument("--hostfile", required=True, help="hostfile that names the host (for its port and user)")
    parser.add_argument("--fingerprint", help="trust only if the node presents this SHA256 fingerprint")
    parser.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    _add_db(parser)


def cmd_trust_host(args: argparse.Namespace) -> int:
    from backend.cluster.ssh import NodeError
    cluster = load_cluster(args.hostfile)
    with _manager(args, reattach=False) as m, _refused(NodeError):
        fingerprint = m.host_key_fingerprint(cluster, args.host)
        if not args.fingerprint and not args.yes:
            answer = input(f"{args.host} presents host key {fingerprint}. Trust it? [y/N] ")
            if answer.strip().lower() not in ("y", "yes"):
                print("not trusted")
                return 1
        trusted = m.trust_host(cluster, args.host, args.fingerprint or fingerprint)
    print(f"trusted {args.host} ({trusted}) in {m.known_hosts}")
    return 0
