"""Runs on a Slurm partition: the target, the batch script the studio writes (and shows), and
Slurm's own tools (`sbatch`, `scontrol`, `scancel`) run from the machine the studio
runs on (the login node, the Pool's local shell).

The job's per-node command is the planner's (`backend.job.planner.plan` on `SlurmTarget.cluster()`):
the script runs node 0's argv on every node of the allocation with three values that only the
allocation knows put in by the shell: `--node_rank` ($SLURM_NODEID), the rendezvous endpoint and
`MASTER_ADDR` (the allocation's first host and a port free on it). Each node's command runs under
the SSH backend's wrapper (`remote.WRAPPER`: `pids/<node>.pid` and `.exit`), so the workers, the
node agent and the failure reading see the same files as on SSH nodes. The node agent is a second,
overlapping step on every node, writing its JSON lines to
`telemetry/attempt-<n>/restart-<k>/<node>.jsonl` in the run directory (shared storage), which the
login node reads. A job Slurm requeues (k = $SLURM_RESTART_COUNT > 0) resumes from the latest
complete checkpoint: the same attempt, recovered by Slurm.

A stop is `scancel`: Slurm sends SIGTERM to every process of the job's steps and SIGKILL after
the cluster's `KillWait`, which must exceed the planner's `STOP_BUDGET_S` for the checkpoint to
be written (docs/cli.md says so; `stop_warning` reads it).
"""
from __future__ import annotations

import asyncio
import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from backend.cluster import remote
from backend.job.cluster import Cluster, Node
from backend.job.planner import NODE_ENV, STOP_BUDGET_S, Plan
from backend.job.spec import JobSpec, Problem, absolute_dir

if TYPE_CHECKING:  # the page imports the target and the script; the SSH and database libraries wait
    from backend.cluster import ssh
    from backend.cluster.nodes import Pool

JOB_NAME_PREFIX = "swift-studio-"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# Slurm's time formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS; or no limit.
_TIME = re.compile(r"^(\d+-\d{1,2}(:\d{1,2}){0,2}|\d+(:\d{1,2}){0,2}|UNLIMITED|INFINITE)$")
_PYTHON = re.compile(r"^[A-Za-z0-9_./+-]+$")
# sbatch reads `#SBATCH` lines itself (no shell), so a path there must need no quoting.
_SCRIPT_PATH = re.compile(r"^/[A-Za-z0-9_./+-]*$")
# Extra sbatch options a user may add: scheduling choices only. Options that change what runs,
# as whom, where its output goes or its environment (--wrap, --uid, --chdir, --output, --export,
# --get-user-env, ...) and the ones the studio sets are refused.
EXTRA_OPTIONS = frozenset({"constraint", "qos", "mem", "mem-per-cpu", "mem-per-gpu", "exclusive", "reservation",
                           "exclude", "nodelist", "mail-type", "mail-user", "nice", "gpus-per-task", "gpu-bind",
                           "hint", "switches", "licenses", "begin", "deadline", "requeue", "no-requeue"})
_EXTRA = re.compile(r"^--([a-z][a-z-]*)(=[A-Za-z0-9_.,:@%+/-]+)?$")

# `scontrol show job -o` states after which the job holds nothing (Slurm's job_state_string).
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
                          "DEADLINE", "OUT_OF_MEMORY", "SPECIAL_EXIT", "REVOKED"})
POLL_S = 1.0
# scancel until the job is gone: Slurm's KillWait (SIGTERM → SIGKILL), then its epilog and cleanup.
CANCEL_WAIT_S = STOP_BUDGET_S + 60.0


# The machine the studio runs on, where Slurm's client tools are (reached without SSH).
LOGIN = Node(host="localhost", slots=1, device="cpu", local=True)


class SlurmError(RuntimeError):
    """A Slurm command failed; the message has the command and Slurm's words."""


@dataclass(frozen=True)
class SlurmTarget:
    """Where a job runs under Slurm. `nodes` is the job's `nnodes`; every node gives the job
    `gpus_per_node` GPUs (0: a CPU job, one worker per CPU of `cpus_per_task`)."""

    partition: str
    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    time_limit: str | None = None
    account: str | None = None
    python: str = "python3"
    """The interpreter on the compute nodes that has swift-studio installed."""
    extra: tuple[str, ...] = ()
    """More `#SBATCH` options (`--qos=high`), from `EXTRA_OPTIONS` only."""

    def problems(self) -> list[Problem]:
        out = []
        if not _NAME.match(self.partition or ""):
            out.append(Problem("slurm.partition", f"{self.partition!r} is not a partition name (letters, digits, _.-)"))
        for name in ("nodes", "cpus_per_task"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                out.append(Problem(f"slurm.{name}", f"must be a whole number of at least 1, got {value!r}"))
        if not isinstance(self.gpus_per_node, int) or isinstance(self.gpus_per_node, bool) or self.gpus_per_node < 0:
            out.append(Problem("slurm.gpus_per_node", f"must be a whole number of at least 0, got {self.gpus_per_node!r}"))
        if self.time_limit is not None and not _TIME.match(self.time_limit):
            out.append(Problem("slurm.time_limit", f"{self.time_limit!r} is not a Slurm time "
                                                   "(minutes, HH:MM:SS, D-HH:MM:SS or UNLIMITED)"))
        if self.account is not None and not _NAME.match(self.account):
            out.append(Problem("slurm.account", f"{self.account!r} is not an account name (letters, digits, _.-)"))
        if not _PYTHON.match(self.python or ""):
            out.append(Problem("slurm.python", f"{self.python!r} is not an interpreter path or name"))
        for i, line in enumerate(self.extra):
            m = _EXTRA.match(line)
            if not m:
                out.append(Problem(f"slurm.extra[{i}]", f"{line!r} is not one `--option[=value]` "
                                                        "(letters, digits and _.,:@%+/- only)"))
            elif m.group(1) not in EXTRA_OPTIONS:
                out.append(Problem(f"slurm.extra[{i}]", f"--{m.group(1)} is not allowed here "
                                                        f"(allowed: {', '.join(sorted(EXTRA_OPTIONS))})"))
        return out

    @property
    def excluded(self) -> list[str]:
        """The hosts its `--exclude` options name, as written (a host list expression unexpanded)."""
        return [h for line in self.extra if line.startswith("--exclude=")
                for h in line.removeprefix("--exclude=").split(",") if h]

    def excluding(self, host: str) -> "SlurmTarget":
        """This target without `host`: one `--exclude` listing it beside those already excluded
        (sbatch keeps only the last of several)."""
        excluded = self.excluded
        others = tuple(line for line in self.extra if not line.startswith("--exclude="))
        hosts = excluded + ([host] if host not in excluded else [])
        return replace(self, extra=(*others, f"--exclude={','.join(hosts)}"))

    @classmethod
    def for_job(cls, spec: JobSpec | None, partition: str | None, gpus_per_node: int = 0,
                cpus_per_task: int | None = None, time_limit: str | None = None, account: str | None = None,
                python: str | None = None, extra: Sequence[str] = ()) -> tuple[SlurmTarget, list[Problem]]:
        """The target for `spec` from what a user gives (the CLI's flags, the Cluster tab's fields):
        the job's `nnodes`; CPUs per task default to the job's processes per node; an extra option
        may be written without its `--`. With every problem of the target against the job; without
        a job (the Cluster tab, before the form is valid) the settings' own problems."""
        target = cls(partition=partition or "", nodes=spec.nnodes if spec else 1, gpus_per_node=gpus_per_node,
                     cpus_per_task=cpus_per_task or (spec.nproc_per_node if spec else None) or 1,
                     time_limit=time_limit or None, account=account or None, python=python or "python3",
                     extra=tuple(o if o.startswith("--") else f"--{o}" for o in extra))
        return target, target.problems() + (target.job_problems(spec) if spec else [])

    def job_problems(self, spec: JobSpec) -> list[Problem]:
        """The target against the job: the allocation is the job's nodes, no more (the planner
        uses the first `nnodes`, the rest would sit idle), no fewer; and an output directory the
        batch script can name."""
        problems = [] if spec.nnodes == self.nodes else [
            Problem("slurm.nodes", f"{self.nodes} nodes, the job's nnodes is {spec.nnodes}")]
        return problems + run_dir_problems(absolute_dir(spec.output_dir))

    def cluster(self) -> Cluster:
        """The allocation as the planner sees it: `nodes` nodes of `gpus_per_node` GPUs (or
        `cpus_per_task` CPU slots). Their names are placeholders; the real hosts are known once
        the job runs, and the script puts them in."""
        device = "cuda" if self.gpus_per_node else "cpu"
        slots = self.gpus_per_node or self.cpus_per_task
        return Cluster(nodes=tuple(Node(host=f"slurm-node-{i}", slots=slots, python=self.python, device=device)
                                   for i in range(self.nodes)), source=f"slurm partition {self.partition}")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["extra"] = list(self.extra)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "slurm") -> SlurmTarget:
        """Raises ValueError naming the unknown key; `problems()` checks the values."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        values = dict(data)
        if "extra" in values:
            values["extra"] = tuple(values["extra"] or ())
        return cls(**values)


def allocation_nodes(target: SlurmTarget, hosts: list[str]) -> list[Node]:
    """The allocation's nodes as the run records them: reached through the login node's shell
    (`local`), since their files are the shared run directory's."""
    base = target.cluster().nodes[0]
    return [Node(host=h, slots=base.slots, python=target.python, device=base.device, local=True) for h in hosts]


# -- the batch script ---------------------------------------------------------------------------

def job_name(run_id: str) -> str:
    return JOB_NAME_PREFIX + run_id


def script_file(attempt: int) -> str:
    return f"slurm/attempt-{int(attempt)}.sbatch"


# Shell variables the batch script sets for every step (srun passes the environment on).
HEAD_VAR, PORT_VAR = "SWIFT_STUDIO_HEAD", "SWIFT_STUDIO_PORT"
# Values of the planner's argv and env that the allocation decides, as shell text (expanded in the step).
_DYNAMIC_ARGS = {"--node_rank": '"$SLURM_NODEID"', "--rdzv_endpoint": f'"${HEAD_VAR}:${PORT_VAR}"'}
_DYNAMIC_ENV = {"MASTER_ADDR": f'"${HEAD_VAR}"', "MASTER_PORT": f'"${PORT_VAR}"', NODE_ENV: '"$node"'}
# The step's node name, as `remote.node_file_name` makes it (Slurm's node names need no stripping).
_NODE_NAME = "node=$(printf %s \"$SLURMD_NODENAME\" | tr -c 'A-Za-z0-9._-' _)"
# The step's import check: the pre-flight that has to run on the allocated nodes themselves.
_IMPORT_CHECK_PY = "import torch, launcher.train, backend.telemetry.agent"
IMPORT_CHECK_FAILED = "swift-studio: the import check failed on a node of the allocation"
PREFLIGHT_FAILED = "swift-studio: the pre-flight failed on the allocation"


def _command(argv: tuple[str, ...] | list[str], env: Mapping[str, str]) -> str:
    """`env K=V ... argv` as shell text, every value quoted but the allocation's (`_DYNAMIC_*`)."""
    remote.check_env(env)
    words = ["env"]
    for name, value in env.items():
        words.append(f"{name}={_DYNAMIC_ENV[name]}" if name in _DYNAMIC_ENV else shlex.quote(f"{name}={value}"))
    words += [f"{name}={text}" for name, text in _DYNAMIC_ENV.items() if name not in env]
    dynamic_next = None
    for arg in argv:
        words.append(dynamic_next if dynamic_next else shlex.quote(str(arg)))
        dynamic_next = _DYNAMIC_ARGS.get(arg)
    return " ".join(words)


def run_dir_problems(path: str) -> list[Problem]:
    """A run directory (or the output directory that holds it) the batch script can name."""
    if _SCRIPT_PATH.match(path):
        return []
    return [Problem("output_dir", f"{path!r}: on Slurm the output directory must be an absolute path of letters, "
                                  "digits and _./+- (sbatch reads the #SBATCH lines that name it unquoted)")]


def sbatch_script(target: SlurmTarget, plan: Plan, run_id: str, attempt: int,
                  offsets: Mapping[str, int] | None = None) -> str:
    """The batch script for one attempt of the run (`plan` from `target.cluster()`). Raises
    ValueError naming the field for a target or run directory it cannot hold safely."""
    problems = target.problems() + run_dir_problems(plan.run_dir)
    if not _NAME.match(run_id):
        problems.append(Problem("name", f"{run_id!r} is not a safe job name"))
    if problems:
        raise ValueError("; ".join(str(p) for p in problems))
    node = plan.nodes[0]
    run_dir = plan.run_dir
    q = shlex.quote
    sbatch = [f"--job-name={job_name(run_id)}", f"--partition={target.partition}", f"--nodes={target.nodes}",
              "--ntasks-per-node=1", f"--cpus-per-task={target.cpus_per_task}"]
    if target.gpus_per_node:
        sbatch.append(f"--gres=gpu:{target.gpus_per_node}")
    if target.time_limit:
        sbatch.append(f"--time={target.time_limit}")
    if target.account:
        sbatch.append(f"--account={target.account}")
    sbatch += [f"--output={run_dir}/logs/slurm-%j.out", "--open-mode=append", *target.extra]

    # A requeued job starts the script again: it resumes unless the attempt already names a checkpoint.
    requeue_resume = "--resume" not in node.argv
    resume_args = ' "$@"' if requeue_resume else ""
    train_step = "; ".join([
        _NODE_NAME,
        f"cd {q(run_dir)}",
        'rm -f "pids/$node.pid" "pids/$node.exit"',
        *(['if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then set -- --resume latest; fi'] if requeue_resume else []),
        # The wrapper is the step's task itself, which slurmstepd makes the leader of its process
        # group (the agent finds the workers by it). Not under setsid: its parent would be the task,
        # die at scancel's SIGTERM and leave the wrapper orphaned, outside what Slurm tracks, so
        # the job would end while the workers still write their checkpoint.
        f"exec sh -c {q(remote.WRAPPER)} swift-studio-node \"$PWD/pids/$node.pid\" \"$PWD/pids/$node.exit\" "
        f"{_command(node.argv, node.env)}{resume_args} < /dev/null > \"logs/$node.log\" 2>&1",
    ])
    agent_argv = [target.python, "-m", "backend.telemetry.agent", "--run-id", run_id, "--run-dir", run_dir,
                  "--offsets", json.dumps(dict(offsets or {}))]
    # The steps get the environment sbatch was called with (its default --export=ALL) and, for the
    # workers, the planner's on top.
    out_dir = f"telemetry/attempt-{int(attempt)}/restart-" + '"${SLURM_RESTART_COUNT:-0}"'
    agent_step = "; ".join([
        _NODE_NAME,
        f"cd {q(run_dir)}",
        f"mkdir -p {out_dir}",
        f"exec {remote.quote_argv(agent_argv)} --node \"$node\" "
        f"> {out_dir}/\"$node.jsonl\" 2>> \"logs/agent-$node.log\"",
    ])
    check_step = remote.quote_argv([target.python, "-c", _IMPORT_CHECK_PY])
    preflight = [target.python, "-m", "backend.cluster.allocation"]
    common = ["--run-dir", run_dir, "--attempt", str(int(attempt)), "--token", f"slurm-{run_id}-{int(attempt)}"]
    probe_step = "; ".join([_NODE_NAME, f"exec {remote.quote_argv([*preflight, 'probe', *common])} --node \"$node\""])
    judge = remote.quote_argv([*preflight, "judge", *common, "--gpus-per-node", str(target.gpus_per_node)])
    # Given to each step: since Slurm 22.05 srun no longer takes --cpus-per-task from the batch
    # job, and a step sees only the GPUs it asks for (the agent reads them through NVML).
    step_resources = f"--ntasks-per-node=1 --cpus-per-task={target.cpus_per_task}"
    if target.gpus_per_node:
        step_resources += f" --gres=gpu:{target.gpus_per_node}"
    lines = [
        "#!/bin/sh",
        f"# swift-studio run {run_id}, attempt {int(attempt)}: written by the studio, submitted with sbatch --parsable",
        *(f"#SBATCH {option}" for option in sbatch),
        "",
        f"cd {q(run_dir)} || exit 1",
        "mkdir -p logs pids",
        "# An earlier attempt's exit codes must not speak for this job if it ends before its workers start.",
        "rm -f pids/*.pid pids/*.exit",
        "# The pre-flight inside the allocation: every node reports (versions, GPUs, disk, interfaces, the",
        "# output directory), this node judges them as the SSH pre-flight would, then the worker imports.",
        f"mkdir -p preflight/attempt-{int(attempt)}",
        f"srun --ntasks-per-node=1 sh -c {q(probe_step)} swift-studio-probe && "
        f"{judge} $(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | tr -c 'A-Za-z0-9._\\n-' _) || "
        f"{{ echo {q(PREFLIGHT_FAILED)} >&2; exit 3; }}",
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 {check_step} || "
        f"{{ echo {q(IMPORT_CHECK_FAILED)} >&2; exit 3; }}",
        "# The rendezvous runs on the allocation's first node, on a port free there (the batch step runs on it).",
        f"{HEAD_VAR}=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)",
        f"{PORT_VAR}=$({q(target.python)} -c {q(remote.FREE_PORT_PY)})",
        f"export {HEAD_VAR} {PORT_VAR}",
        f"srun {step_resources} --kill-on-bad-exit=1 sh -c {q(train_step)} swift-studio-step &",
        "train=$!",
        f"srun --overlap {step_resources} sh -c {q(agent_step)} swift-studio-agent &",
        "wait $train; rc=$?",
        "wait",
        "exit $rc",
        "",
    ]
    return "\n".join(lines)


# -- job state ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class JobState:
    job_id: str
    state: str                      # Slurm's JobState: PENDING, RUNNING, COMPLETED, CANCELLED, ...
    reason: str | None = None
    exit_code: int | None = None    # of the batch script
    signal: int | None = None
    nodes: str | None = None        # NodeList, Slurm's compressed form
    requeued: int = 0               # Restarts

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES

    @property
    def running(self) -> bool:
        return self.state in ("RUNNING", "COMPLETING", "SUSPENDED", "STOPPED")


_FIELD = re.compile(r"(\S+?)=(\S*)")
_JOB_ID = re.compile(r"^[0-9]+$")
_EXIT = re.compile(r"^(-?[0-9]+):(-?[0-9]+)$")


def _fields(line: str) -> dict[str, str]:
    """`Key=Value` words, the first of each key: a later one (inside a Comment=…) cannot override it."""
    out: dict[str, str] = {}
    for key, value in _FIELD.findall(line):
        out.setdefault(key, value)
    return out


def parse_scontrol_job(text: str, job_id: str) -> JobState | None:
    """`scontrol show job -o <id>` (one line, `Key=Value` words) → the job's state; None for a job
    Slurm no longer knows (`slurm_load_jobs error: Invalid job id specified`)."""
    for line in text.splitlines():
        values = _fields(line)
        if values.get("JobId") != str(job_id):
            continue
        exit_code = sig = None
        if "ExitCode" in values:
            m = _EXIT.match(values["ExitCode"])
            if not m:
                raise SlurmError(f"scontrol show job {job_id}: unreadable ExitCode={values['ExitCode']!r}")
            exit_code, sig = int(m.group(1)), int(m.group(2))
        restarts = values.get("Restarts", "0") or "0"
        if not _JOB_ID.match(restarts):
            raise SlurmError(f"scontrol show job {job_id}: unreadable Restarts={restarts!r}")
        reason = values.get("Reason")
        nodes = values.get("NodeList")
        return JobState(job_id=str(job_id), state=values.get("JobState", ""),
                        reason=None if reason in (None, "None") else reason, exit_code=exit_code, signal=sig,
                        nodes=None if nodes in (None, "", "(null)") else nodes, requeued=int(restarts))
    return None


def parse_sbatch(text: str) -> str:
    """`sbatch --parsable` prints `<job id>` or `<job id>;<cluster>`."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    job_id = first.split(";")[0]
    if not _JOB_ID.match(job_id):
        raise SlurmError(f"sbatch printed no job id: {text.strip()[:200]!r}")
    return job_id


def parse_hostnames(text: str) -> list[str]:
    """`scontrol show hostnames <list>`: one host a line."""
    return [h for h in (line.strip() for line in text.splitlines()) if h]


_KILL_WAIT = re.compile(r"^KillWait\s*=\s*(\d+)\s*sec", re.MULTILINE)


def stop_warning(scontrol_config: str) -> str | None:
    """A warning when the cluster's KillWait (`scontrol show config`) kills the workers before
    their stop budget (a stop would end without a checkpoint)."""
    m = _KILL_WAIT.search(scontrol_config)
    if m and int(m.group(1)) <= STOP_BUDGET_S:
        return (f"slurm: KillWait is {m.group(1)} s, not more than the workers' {STOP_BUDGET_S:g} s stop budget: "
                "a stop may kill them before their checkpoint is written")
    return None


# -- Slurm's tools, on the login node -----------------------------------------------------------

async def _run(pool: Pool, login: Node, argv: list[str], timeout: float = 30.0, input: str | None = None) -> ssh.Result:
    return await pool.run(login, remote.quote_argv(argv), None, input=input, timeout=timeout)


async def submit(pool: Pool, login: Node, run_dir: str, script: str) -> str:
    """`sbatch --parsable <script>` (a file in the run directory, already written); the job id."""
    await pool.run(login, f"mkdir -p -- {shlex.quote(run_dir)}/logs", None, timeout=15)
    res = await _run(pool, login, ["sbatch", "--parsable", f"--chdir={run_dir}", script])
    if not res.ok:
        raise SlurmError(f"sbatch {script}: {res.first_error_line()}")
    return parse_sbatch(res.stdout)


async def job_state(pool: Pool, login: Node, job_id: str) -> JobState | None:
    """The job as Slurm's controller has it; None once it forgot the job (MinJobAge after its end)."""
    res = await _run(pool, login, ["scontrol", "show", "job", "-o", str(job_id)])
    if res.ok:
        return parse_scontrol_job(res.stdout, job_id)
    if "Invalid job id" in res.stdout + res.stderr:
        return None
    raise SlurmError(f"scontrol show job {job_id}: {res.first_error_line()}")


async def hostnames(pool: Pool, login: Node, nodelist: str) -> list[str]:
    res = await _run(pool, login, ["scontrol", "show", "hostnames", nodelist])
    if not res.ok:
        raise SlurmError(f"scontrol show hostnames {nodelist}: {res.first_error_line()}")
    return parse_hostnames(res.stdout)


async def config_warning(pool: Pool, login: Node) -> str | None:
    res = await _run(pool, login, ["scontrol", "show", "config"])
    return stop_warning(res.stdout) if res.ok else None


_GPU_GRES = re.compile(r"(?:^|,)gpu(?::[A-Za-z0-9_.-]+)?:(\d+)")


def parse_sinfo(text: str) -> dict[str, tuple[int, int]]:
    """`sinfo -h -N -o %N|%c|%G` as {node: (CPUs, GPUs)}; a node listed twice (in two partitions)
    counts once, a line that is not of this form not at all."""
    nodes: dict[str, tuple[int, int]] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 3 or not _NAME.match(parts[0]) or not parts[1].isdigit():
            continue
        gpus = sum(int(m.group(1)) for m in _GPU_GRES.finditer(parts[2].split("(")[0]))
        nodes.setdefault(parts[0], (int(parts[1]), gpus))
    return nodes


def partition_problems(target: SlurmTarget, nodes: Mapping[str, tuple[int, int]]) -> list[Problem]:
    """Whether the partition's nodes (`parse_sinfo`) can ever hold the job: Slurm would keep a job
    it can never schedule pending, with a reason only squeue shows."""
    if not nodes:
        return [Problem("slurm.partition", f"partition {target.partition!r} does not exist or has no nodes "
                                           f"(sinfo -p {target.partition})")]
    excluded = set(target.excluded) & set(nodes)
    fit = [n for n, (cpus, gpus) in nodes.items()
           if n not in excluded and cpus >= target.cpus_per_task and gpus >= target.gpus_per_node]
    if len(fit) >= target.nodes:
        return []
    need = f"{target.cpus_per_task} CPUs" + (f" and {target.gpus_per_node} GPUs (gres gpu)" if target.gpus_per_node else "")
    left_out = f", {len(excluded)} excluded" if excluded else ""
    return [Problem("slurm.nodes", f"the job needs {target.nodes} node(s) with {need} each; partition "
                                   f"{target.partition!r} has {len(fit)} of {len(nodes)} such node(s){left_out} "
                                   f"({', '.join(f'{n}: {c} CPUs, {g} GPUs' for n, (c, g) in sorted(nodes.items())[:8])})")]


async def check_partition(pool: Pool, login: Node, target: SlurmTarget) -> list[Problem]:
    """The pre-flight a login node can do: the partition exists and has nodes the job fits on.
    Raises SlurmError where sinfo fails (no controller)."""
    res = await _run(pool, login, ["sinfo", "-h", "-N", f"--partition={target.partition}", "-o", "%N|%c|%G"])
    if not res.ok:
        raise SlurmError(f"sinfo --partition={target.partition}: {res.first_error_line()}")
    return partition_problems(target, parse_sinfo(res.stdout))


async def jobs_named(pool: Pool, login: Node, run_id: str) -> list[str]:
    """The ids of this user's jobs that carry the run's job name (`squeue --me --name`)."""
    res = await _run(pool, login, ["squeue", "--me", "-h", f"--name={job_name(run_id)}", "-o", "%i"])
    if not res.ok:
        raise SlurmError(f"squeue --name={job_name(run_id)}: {res.first_error_line()}")
    return [line.strip() for line in res.stdout.splitlines() if _JOB_ID.match(line.strip())]


async def cancel(pool: Pool, login: Node, job_id: str, wait_s: float = CANCEL_WAIT_S) -> JobState | None:
    """`scancel` (SIGTERM to every step's processes, SIGKILL after KillWait), then wait until the
    job has ended; its last state (None: Slurm forgot it). Raises SlurmError when it outlives `wait_s`."""
    res = await _run(pool, login, ["scancel", str(job_id)])
    if not res.ok and "Invalid job id" not in res.stdout + res.stderr:
        raise SlurmError(f"scancel {job_id}: {res.first_error_line()}")
    loop = asyncio.get_running_loop()
    end = loop.time() + wait_s
    while True:
        state = await job_state(pool, login, job_id)
        if state is None or state.final:
            return state
        if loop.time() >= end:
            raise SlurmError(f"job {job_id} is still {state.state} {wait_s:.0f} s after scancel")
        await asyncio.sleep(POLL_S)
