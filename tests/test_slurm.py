"""The Slurm backend's pure part: the target's field checks, the batch script (planner's argv, no
injection) and the parsing of Slurm's own output (captured from slurm-wlm 22.05 on this machine)."""
from __future__ import annotations

import json
import subprocess
from dataclasses import replace

import pytest

from backend.cluster import slurm
from backend.cluster.slurm import SlurmTarget
from backend.job.demo import demo_spec
from backend.job.planner import plan
from backend.job.spec import JobSpec

RUNNING = ("JobId=1 JobName=job.sh UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 Nice=0 "
           "Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 "
           "Reboot=0 ExitCode=0:0 RunTime=00:00:00 TimeLimit=UNLIMITED TimeMin=N/A SubmitTime=2026-12-02T02:11:02 "
           "EligibleTime=2026-12-02T02:11:02 AccrueTime=2026-12-02T02:11:02 StartTime=2026-12-02T02:11:05 EndTime=Unknown "
           "Deadline=N/A SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-12-02T02:11:05 Scheduler=Main Partition=debug "
           "AllocNode:Sid=localhost:6574 ReqNodeList=(null) ExcNodeList=(null) NodeList=localhost BatchHost=localhost "
           "NumNodes=1 NumCPUs=2 NumTasks=1 CPUs/Task=2 ReqB:S:C:T=0:0:*:* TRES=cpu=2,node=1,billing=2 Socks/Node=* "
           "NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=2 MinMemoryNode=0 MinTmpDiskNode=0 Features=(null) "
           "DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) Command=/tmp/slt/job.sh "
           "WorkDir=/work/wt-slurm/tests StdErr=/tmp/slt/j-1.out StdIn=/dev/null StdOut=/tmp/slt/j-1.out Power= \n")
PENDING = ("JobId=2 JobName=job.sh UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901758 Nice=0 "
           "Account=(null) QOS=(null) JobState=PENDING Reason=Resources Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 "
           "Reboot=0 ExitCode=0:0 RunTime=00:00:00 TimeLimit=UNLIMITED TimeMin=N/A SubmitTime=2026-12-02T02:11:02 "
           "StartTime=Unknown EndTime=Unknown Partition=debug AllocNode:Sid=localhost:6574 ReqNodeList=(null) "
           "ExcNodeList=(null) NodeList= NumNodes=1 NumCPUs=2 NumTasks=1 CPUs/Task=2 TRES=cpu=2,mem=12052M,node=1,billing=2 "
           "Command=/tmp/slt/job.sh WorkDir=/work/wt-slurm/tests StdErr=/tmp/slt/j-2.out StdIn=/dev/null Power= \n")
CANCELLED = ("JobId=1 JobName=job.sh UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 Nice=0 "
             "Account=(null) QOS=(null) JobState=CANCELLED Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 "
             "Reboot=0 ExitCode=0:15 RunTime=00:00:00 TimeLimit=UNLIMITED TimeMin=N/A Partition=debug "
             "NodeList=localhost BatchHost=localhost NumNodes=1 NumCPUs=2 NumTasks=1 CPUs/Task=2 Power= \n")


def target(**kw) -> SlurmTarget:
    return SlurmTarget(**{"partition": "debug", "nodes": 1, "cpus_per_task": 2, **kw})


def demo_plan(tmp_path, t: SlurmTarget, **spec_kw):
    spec = demo_spec(tmp_path).model_copy(update={"nnodes": t.nodes, "nproc_per_node": 2, **spec_kw})
    return plan(spec, t.cluster(), "run-1", str(tmp_path / "run-1"))


@pytest.mark.parametrize("kw, field", [
    ({"partition": "de bug"}, "slurm.partition"), ({"partition": "a\n#SBATCH --wrap=x"}, "slurm.partition"),
    ({"nodes": 0}, "slurm.nodes"), ({"cpus_per_task": True}, "slurm.cpus_per_task"),
    ({"gpus_per_node": -1}, "slurm.gpus_per_node"), ({"time_limit": "1 hour"}, "slurm.time_limit"),
    ({"account": "x;y"}, "slurm.account"), ({"python": "python3 -c boom"}, "slurm.python"),
    ({"extra": ("--wrap=id",)}, "slurm.extra[0]"), ({"extra": ("--qos=high", "--export=ALL,LD_PRELOAD=/x")}, "slurm.extra[1]"),
    ({"extra": ("--qos=high\n#SBATCH --uid=0",)}, "slurm.extra[0]"), ({"extra": ("--output=/etc/x",)}, "slurm.extra[0]"),
])
def test_target_problems_name_the_field(kw, field):
    assert [p.field for p in target(**kw).problems()] == [field]


def test_a_good_target_has_no_problems_and_round_trips():
    t = target(gpus_per_node=8, time_limit="1-02:00:00", account="ml-team", extra=("--qos=high", "--exclusive"))
    assert t.problems() == []
    assert SlurmTarget.from_dict(t.to_dict()) == t
    with pytest.raises(ValueError, match="unknown key 'gres'"):
        SlurmTarget.from_dict({"partition": "debug", "gres": "gpu:8"})
    spec = demo_spec(output_dir="/shared/out")
    assert t.job_problems(spec) == [] and [p.field for p in t.job_problems(spec.model_copy(update={"nnodes": 2}))] == [
        "slurm.nodes"]
    # sbatch reads #SBATCH lines unquoted: an output directory it cannot name is the form's error, before a run exists.
    _, problems = SlurmTarget.for_job(spec.model_copy(update={"output_dir": "/shared/my runs"}), "debug")
    assert [p.field for p in problems] == ["output_dir"] and "'/shared/my runs'" in problems[0].message


def test_the_allocation_as_the_planner_sees_it():
    gpu, cpu = target(nodes=2, gpus_per_node=4).cluster(), target(cpus_per_task=3).cluster()
    assert [(n.slots, n.device) for n in gpu.nodes] == [(4, "cuda"), (4, "cuda")]
    assert [(n.slots, n.device) for n in cpu.nodes] == [(3, "cpu")]


def test_script_has_the_sbatch_lines_and_the_planners_worker(tmp_path):
    t = target(nodes=1, gpus_per_node=2, time_limit="30", account="acct", extra=("--qos=high",))
    p = demo_plan(tmp_path, t)
    text = slurm.sbatch_script(t, p, "run-1", attempt=2, offsets={"events/rank-0.jsonl": 10})
    options = [line.split(" ", 1)[1] for line in text.splitlines() if line.startswith("#SBATCH ")]
    assert options == ["--job-name=swift-studio-run-1", "--partition=debug", "--nodes=1", "--ntasks-per-node=1",
                       "--cpus-per-task=2", "--gres=gpu:2", "--time=30", "--account=acct",
                       f"--output={tmp_path}/run-1/logs/slurm-%j.out", "--open-mode=append", "--qos=high"]
    # The planner's argv, with the allocation's values put in by the shell.
    assert '--node_rank "$SLURM_NODEID"' in text and '--rdzv_endpoint "$SWIFT_STUDIO_HEAD:$SWIFT_STUDIO_PORT"' in text
    assert "-m launcher.train --run-dir" in text and "--rdzv_id run-1" in text
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in text
    # Each step asks for the node's CPUs and GPUs itself (srun does not inherit them since 22.05).
    assert "srun --ntasks-per-node=1 --cpus-per-task=2 --gres=gpu:2 --kill-on-bad-exit=1 sh -c" in text
    assert "srun --overlap --ntasks-per-node=1 --cpus-per-task=2 --gres=gpu:2 sh -c" in text
    assert "telemetry/attempt-2" in text
    assert "rank-0.jsonl" in text  # the agent starts after what earlier attempts' agents read
    subprocess.run(["sh", "-n"], input=text, text=True, check=True)


def test_script_refuses_what_it_cannot_write_safely(tmp_path):
    t = target()
    p = demo_plan(tmp_path, t)
    with pytest.raises(ValueError, match="output_dir"):
        slurm.sbatch_script(t, replace(p, run_dir="/tmp/my runs/x"), "run-1", 1)
    with pytest.raises(ValueError, match="slurm.extra"):
        slurm.sbatch_script(replace(t, extra=("--chdir=/",)), p, "run-1", 1)
    with pytest.raises(ValueError, match="name"):
        slurm.sbatch_script(t, p, "run;id", 1)


def test_an_env_value_is_data_in_the_step(tmp_path):
    """A value with a newline, `$(...)`, backticks and quotes reaches the process unchanged and
    runs nothing (the step's shell text is what srun's `sh -c` gets)."""
    evil = "a\n$(touch pwned)`touch pwned2`'\";touch pwned3 #"
    command = slurm._command(["sh", "-c", 'printf %s "$EVIL"; printf "|%s" "$MASTER_ADDR" "$1"', "x", "$SLURM_NODEID"],
                             {"EVIL": evil, "MASTER_ADDR": "planner-placeholder"})
    out = subprocess.run(["sh", "-c", command], cwd=tmp_path, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "SWIFT_STUDIO_HEAD": "head-1", "SLURM_NODEID": "0"})
    assert out.stdout == evil + "|head-1|$SLURM_NODEID"
    assert list(tmp_path.iterdir()) == []


def test_parse_scontrol_job():
    running = slurm.parse_scontrol_job(RUNNING, "1")
    assert (running.state, running.nodes, running.exit_code, running.running, running.final) == (
        "RUNNING", "localhost", 0, True, False)
    pending = slurm.parse_scontrol_job(PENDING, "2")
    assert (pending.state, pending.reason, pending.nodes, pending.running) == ("PENDING", "Resources", None, False)
    cancelled = slurm.parse_scontrol_job(CANCELLED, "1")
    assert (cancelled.state, cancelled.signal, cancelled.final) == ("CANCELLED", 15, True)
    assert slurm.parse_scontrol_job(RUNNING, "12") is None


def test_crafted_scontrol_output_cannot_override_the_state_or_crash_the_watch():
    """A job's Comment (which its owner sets) holding `JobState=COMPLETED` does not override the
    real state (the first key wins); numbers that are not numbers are a SlurmError, not a crash."""
    crafted = RUNNING.replace("Power= ", "Comment=JobState=COMPLETED ExitCode=0:0 Power= ")
    assert slurm.parse_scontrol_job(crafted, "1").state == "RUNNING"
    for bad in ("ExitCode=0:0", "Restarts=0"):
        with pytest.raises(slurm.SlurmError, match="unreadable"):
            slurm.parse_scontrol_job(RUNNING.replace(bad, bad.split("=")[0] + "=x"), "1")
    with pytest.raises(slurm.SlurmError, match="no job id"):
        slurm.parse_sbatch("\u00b2\n")  # str.isdigit() says yes to a superscript two


def test_a_second_exclusion_keeps_the_first():
    t = target(extra=("--qos=high", "--exclude=gpu-9"))
    twice = t.excluding("gpu-1").excluding("gpu-2").excluding("gpu-1")
    assert twice.extra == ("--qos=high", "--exclude=gpu-9,gpu-1,gpu-2") and twice.problems() == []


def test_the_script_removes_an_earlier_attempts_exit_codes_before_anything_can_fail(tmp_path):
    """Otherwise a job that ends before its workers start (the import check) would be explained
    by the last attempt's exit code and log."""
    t = target()
    text = slurm.sbatch_script(t, demo_plan(tmp_path, t), "run-1", attempt=2)
    lines = text.splitlines()
    first_srun = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert lines.index("rm -f pids/*.pid pids/*.exit") < first_srun


def test_parse_sbatch_hostnames_and_killwait():
    assert slurm.parse_sbatch("17\n") == "17" and slurm.parse_sbatch("17;cluster-a\n") == "17"
    with pytest.raises(slurm.SlurmError, match="no job id"):
        slurm.parse_sbatch("sbatch: error: Batch job submission failed: Invalid partition name specified\n")
    assert slurm.parse_hostnames("gpu-01\ngpu-02\n") == ["gpu-01", "gpu-02"]
    assert slurm.stop_warning("KillWait                = 45 sec\n") is None
    assert "KillWait is 30 s" in slurm.stop_warning("KillWait                = 30 sec\n")


def _outcome(run_dir, state: slurm.JobState | None, hosts: list[str], job_id: str | None = None):
    import asyncio

    from backend.cluster.nodes import Pool
    from backend.runs.slurmwatch import SlurmWatcher

    async def go():
        pool = Pool()
        try:
            watcher = SlurmWatcher(pool, slurm.LOGIN, "run-1", str(run_dir), job_id or state.job_id, 1, lambda: False,
                                   lambda hosts: None, hosts=hosts)
            return await watcher.outcome(state)
        finally:
            await pool.close()

    return asyncio.run(go())


def test_a_failed_job_is_explained_by_the_ranks_own_report(tmp_path):
    """Read through the login node's shell from the shared run directory, as on SSH nodes: the
    exit code, the end slot of the node's workers (same group, same node) and the log."""
    for d in ("pids", "logs", "events"):
        (tmp_path / d).mkdir()
    (tmp_path / "pids/gpu-2.pid").write_text("4242\n")
    (tmp_path / "pids/gpu-2.exit").write_text("1  \n")
    (tmp_path / "pids/gpu-1.pid").write_text("4141\n")
    (tmp_path / "pids/gpu-1.exit").write_text("0  \n")
    (tmp_path / "logs/gpu-2.log").write_text("[rank1] error: DataError: train.jsonl:7: no messages\n")
    end = {"type": "end", "status": "failed", "rank": 1, "node": "gpu-2", "pgid": 4242, "error_type": "DataError",
           "error": "train.jsonl:7: no messages", "time": 1.0}
    stale = {**end, "pgid": 999, "error_type": "ConfigError", "error": "an earlier attempt's"}
    (tmp_path / "events/rank-1.end").write_text(json.dumps(end) + "\n" + json.dumps(stale) + "\n")
    out = _outcome(tmp_path, slurm.JobState("7", "FAILED", exit_code=1), ["gpu-1", "gpu-2"])
    assert out.state == "failed"
    assert (out.failure.node, out.failure.cause, out.failure.exit_code) == ("gpu-2", "data_error", 1)
    assert "train.jsonl:7" in out.failure.message and "Slurm job 7 ended FAILED" in out.failure.message


def test_a_job_that_never_started_its_workers(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs/slurm-8.out").write_text(f"srun: error: execve(): /opt/nope: No such file\n"
                                               f"{slurm.IMPORT_CHECK_FAILED}\n")
    out = _outcome(tmp_path, slurm.JobState("8", "FAILED", exit_code=3), ["gpu-1"])
    assert (out.failure.cause, out.failure.node) == ("command_not_found", None)
    assert "slurm.python" in out.failure.message and "logs/slurm-8.out" in out.failure.message
    timeout = _outcome(tmp_path, slurm.JobState("9", "TIMEOUT", exit_code=0, signal=15), [])
    assert timeout.failure.cause == "killed" and "ended TIMEOUT" in timeout.failure.message
    assert _outcome(tmp_path, slurm.JobState("10", "COMPLETED", exit_code=0), []).state == "succeeded"


def test_a_job_slurm_forgot_is_judged_by_its_nodes_exit_codes(tmp_path):
    """Past MinJobAge `scontrol` no longer knows the job (a studio down overnight): the nodes' exit
    codes in the run directory say how it ended."""
    (tmp_path / "pids").mkdir()
    (tmp_path / "logs").mkdir()
    for host, code in (("gpu-1", 0), ("gpu-2", 0)):
        (tmp_path / f"pids/{host}.pid").write_text("4141\n")
        (tmp_path / f"pids/{host}.exit").write_text(f"{code}  \n")
    assert _outcome(tmp_path, None, ["gpu-1", "gpu-2"], job_id="11").state == "succeeded"
    (tmp_path / "pids/gpu-2.exit").write_text("1  \n")
    (tmp_path / "logs/gpu-2.log").write_text("[rank1] error: RuntimeError: boom\n")
    failed = _outcome(tmp_path, None, ["gpu-1", "gpu-2"], job_id="11")
    assert (failed.state, failed.failure.node) == ("failed", "gpu-2") and "unknown to Slurm" in failed.failure.message


def test_a_silent_controller_cancels_the_job_before_failing_it(tmp_path, monkeypatch):
    """A restart must not start a second job beside one that may still run: the silent job is
    cancelled first, and one that cannot be cancelled fails with a cause no restart follows."""
    import asyncio

    from backend.runs.slurmwatch import SlurmWatcher
    from backend.telemetry import logclass

    cancelled = []

    async def cancel(pool, login, job_id):
        cancelled.append(job_id)

    async def unreachable(pool, login, job_id):
        raise slurm.SlurmError("scancel 12: Unable to contact slurm controller")

    watcher = SlurmWatcher(None, slurm.LOGIN, "run-1", str(tmp_path), "12", 1, lambda: False, lambda hosts: None)
    monkeypatch.setattr(slurm, "cancel", cancel)
    gone = asyncio.run(watcher._silent(slurm.SlurmError("timed out")))
    assert cancelled == ["12"] and gone.failure.cause == logclass.NODE_UNREACHABLE
    monkeypatch.setattr(slurm, "cancel", unreachable)
    alive = asyncio.run(watcher._silent(slurm.SlurmError("timed out")))
    assert alive.failure.cause not in logclass.RESTARTABLE and "squeue -j 12" in alive.failure.message


def test_a_hung_job_is_cancelled_and_fails_as_a_hang(tmp_path, monkeypatch):
    """The SSH watch's hang rule, asked each round while the job runs, from when it was first
    seen running (or last requeued); the job is cancelled before the attempt fails."""
    import asyncio
    import time

    from backend.cluster.nodes import Pool
    from backend.runs import slurmwatch
    from backend.telemetry import logclass
    from backend.telemetry.alerts import Finding

    asked, cancelled, stopping, states = [], [], [], iter([slurm.JobState("13", "RUNNING"), slurm.JobState("13", "RUNNING"),
                                             slurm.JobState("13", "RUNNING", requeued=1),
                                             slurm.JobState("13", "RUNNING", requeued=1)])

    class Sink:
        def read_offsets(self, run_id, prefix):
            return {}

        def on_agent_line(self, *args, **kw):
            pass

        def stopping_hung(self, run_id, attempt, finding):
            stopping.append((run_id, attempt, finding.key))

        def awaiting_flight(self, run_id, request):
            return False

        def hang(self, run_id, since):
            asked.append(since)
            return (Finding("hang", "hang:12", "error", time.time(), "no training step for 11 s (last logged step 12)",
                            node="gpu-2", rank=3) if len(asked) >= 4 else None)

    async def job_state(pool, login, job_id):
        return next(states)

    async def cancel(pool, login, job_id):
        cancelled.append(job_id)

    monkeypatch.setattr(slurm, "job_state", job_state)
    monkeypatch.setattr(slurm, "cancel", cancel)
    monkeypatch.setattr(slurmwatch, "WATCH_INTERVAL_S", 0.01)

    async def go():
        pool = Pool()
        try:
            watcher = slurmwatch.SlurmWatcher(pool, slurm.LOGIN, "run-1", str(tmp_path), "13", 1, lambda: False,
                                              lambda hosts: None, sink=Sink(), on_notice=lambda m: None,
                                              hosts=["gpu-1", "gpu-2"])
            return await watcher.run()
        finally:
            await pool.close()

    out = asyncio.run(go())
    assert cancelled == ["13"] and stopping == [("run-1", 1, "hang:12")]
    assert (out.state, out.failure.cause, out.failure.node) == ("failed", logclass.HANG, "gpu-2")
    assert "last logged step 12" in out.failure.message and "cancelled Slurm job 13" in out.failure.message
    assert asked[0] == asked[1] < asked[2] == asked[3], asked  # the requeue restarted the count


def test_a_suspended_job_is_not_hung_and_a_reattached_watch_does_not_report_old_requeues(tmp_path, monkeypatch):
    """While Slurm suspends a job (preemption) its ranks cannot step: the hang rule is not asked,
    and counts again from when it runs. A watch that starts on a job requeued before it (a
    re-attach) takes those requeues as seen, and keeps the stored nodes when Slurm names the same."""
    import asyncio

    from backend.runs import slurmwatch

    states = iter([slurm.JobState("15", "RUNNING", requeued=2, nodes="gpu-1"),
                   slurm.JobState("15", "SUSPENDED", requeued=2, nodes="gpu-1"),
                   slurm.JobState("15", "RUNNING", requeued=2, nodes="gpu-1"),
                   slurm.JobState("15", "COMPLETED", requeued=2, nodes="gpu-1", exit_code=0)])
    asked, notices, allocations = [], [], []

    class Sink:
        def read_offsets(self, run_id, prefix):
            return {}

        def hang(self, run_id, since):
            asked.append(since)

    async def job_state(pool, login, job_id):
        return next(states)

    async def hostnames(pool, login, nodelist):
        return [nodelist]

    monkeypatch.setattr(slurm, "job_state", job_state)
    monkeypatch.setattr(slurm, "hostnames", hostnames)
    monkeypatch.setattr(slurmwatch, "WATCH_INTERVAL_S", 0.01)
    watcher = slurmwatch.SlurmWatcher(None, slurm.LOGIN, "run-1", str(tmp_path), "15", 1, lambda: False,
                                      allocations.append, sink=Sink(), on_notice=notices.append, hosts=["gpu-1"])
    watcher.read_telemetry = lambda: asyncio.sleep(0)
    assert asyncio.run(watcher.run()).state == "succeeded"
    assert len(asked) == 2 and asked[0] < asked[1], asked
    assert notices == [] and allocations == []


def test_a_requeued_job_is_followed_onto_the_nodes_it_runs_on_next(tmp_path, monkeypatch):
    """A job Slurm requeued (a node failed) may start again elsewhere: the watch reads its nodes
    again, so the Monitor, the failure's node and the exit files are the new allocation's."""
    import asyncio

    from backend.runs import slurmwatch

    states = iter([slurm.JobState("14", "RUNNING", nodes="gpu-[1-2]"), slurm.JobState("14", "RUNNING", nodes="gpu-[1-2]"),
                   slurm.JobState("14", "PENDING", requeued=1),
                   slurm.JobState("14", "RUNNING", requeued=1, nodes="gpu-[2-3]"),
                   slurm.JobState("14", "COMPLETED", requeued=1, nodes="gpu-[2-3]", exit_code=0)])
    allocations = []

    async def job_state(pool, login, job_id):
        return next(states)

    async def hostnames(pool, login, nodelist):
        first, last = nodelist.removeprefix("gpu-[").removesuffix("]").split("-")
        return [f"gpu-{i}" for i in range(int(first), int(last) + 1)]

    monkeypatch.setattr(slurm, "job_state", job_state)
    monkeypatch.setattr(slurm, "hostnames", hostnames)
    monkeypatch.setattr(slurmwatch, "WATCH_INTERVAL_S", 0.01)
    watcher = slurmwatch.SlurmWatcher(None, slurm.LOGIN, "run-1", str(tmp_path), "14", 1, lambda: False,
                                      allocations.append, on_notice=lambda m: None)
    assert asyncio.run(watcher.run()).state == "succeeded"
    assert allocations == [["gpu-1", "gpu-2"], ["gpu-2", "gpu-3"]]
    assert watcher.hosts == ["gpu-2", "gpu-3"]


def test_a_watch_that_starts_again_reads_the_agent_files_on_from_where_the_store_got(tmp_path):
    """A studio restarted while a Slurm job runs re-attaches with a new watch: it must go on from
    the offsets committed with the samples, not store every GPU sample of the job again, and a
    line half written when it last read is taken once it is whole."""
    import asyncio

    import sqlalchemy

    from backend.cluster.nodes import Pool
    from backend.runs.slurmwatch import SlurmWatcher
    from backend.telemetry.ingest import Ingestor

    agent = tmp_path / "telemetry" / "attempt-1" / "restart-0" / "gpu-1.jsonl"
    agent.parent.mkdir(parents=True)

    def sample(t):
        return json.dumps({"kind": "gpu", "t": 1000.0 + t, "gpu": 0, "util_pct": 50.0, "mem_used_gib": 1.0}) + "\n"

    db = f"sqlite:///{tmp_path / 'telemetry.db'}"

    def watch_once():
        """A new studio process: its own ingestor on the database, its own watch of job 21."""
        engine = sqlalchemy.create_engine(db)
        sink = Ingestor(engine, autostart=False)

        async def go():
            pool = Pool()
            try:
                await SlurmWatcher(pool, slurm.LOGIN, "run-1", str(tmp_path), "21", 1, lambda: False,
                                   lambda hosts: None, sink=sink).read_telemetry()
            finally:
                await pool.close()
        asyncio.run(go())
        sink.flush()
        with engine.connect() as conn:
            count = conn.execute(sqlalchemy.text("SELECT COUNT(*) FROM telemetry_sample")).scalar()
        engine.dispose()
        return count

    first = sample(0) + sample(1)
    half = sample(2)
    agent.write_text(first + half[:10])
    stored = watch_once()
    assert stored > 0
    per_line = stored // 2
    assert watch_once() == stored  # nothing new in the file: nothing stored again
    with agent.open("a") as f:
        f.write(half[10:] + sample(3))
    assert watch_once() == stored + 2 * per_line


def test_cli_plan_shows_the_script_and_names_the_flags(tmp_path, capsys):
    from backend import cli

    job = tmp_path / "job.yaml"
    job.write_text(demo_spec(tmp_path / "out").model_copy(update={"nproc_per_node": 2}).to_yaml())
    assert cli.main(["plan", str(job), "--slurm-partition", "debug", "--slurm-option", "qos=high",
                     "--run-id", "r1"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --cpus-per-task=2" in out and "#SBATCH --qos=high" in out and "--rdzv_id r1" in out
    assert cli.main(["plan", str(job), "--slurm-partition", "a b", "--slurm-time", "1h",
                     "--slurm-option", "export=ALL,LD_PRELOAD=/x"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert [line.split(":")[0] for line in err] == ["--slurm-partition", "--slurm-time", "--slurm-option #1"]
    assert cli.main(["run", str(job), "--slurm-partition", "debug", "--hostfile", "hosts"]) == 1
    assert "--hostfile, --slurm-partition" in capsys.readouterr().err


def test_sinfo_nodes_and_whether_the_partition_can_hold_the_job():
    nodes = slurm.parse_sinfo("gpu-01|64|gpu:a100:8(S:0-1)\ngpu-02|64|gpu:8\ngpu-02|64|gpu:8\ncpu-01|32|(null)\n"
                              "garbage line\nbad name!|4|(null)\n")
    assert nodes == {"gpu-01": (64, 8), "gpu-02": (64, 8), "cpu-01": (32, 0)}
    fits = slurm.SlurmTarget("p", nodes=2, gpus_per_node=8, cpus_per_task=16)
    assert slurm.partition_problems(fits, nodes) == []
    too_many = slurm.partition_problems(replace(fits, nodes=3), nodes)
    assert [p.field for p in too_many] == ["slurm.nodes"]
    assert "needs 3 node(s) with 16 CPUs and 8 GPUs" in too_many[0].message and "has 2 of 3" in too_many[0].message
    assert "has 2 of 3" in slurm.partition_problems(slurm.SlurmTarget("p", cpus_per_task=33, nodes=3), nodes)[0].message
    # A node left out after failing twice no longer counts (the job would pend for ever).
    without = slurm.partition_problems(fits.excluding("gpu-02"), nodes)
    assert "has 1 of 3 such node(s), 1 excluded" in without[0].message, without
    missing = slurm.partition_problems(fits, {})
    assert [p.field for p in missing] == ["slurm.partition"] and "'p' does not exist" in missing[0].message


def test_a_target_for_a_job_takes_its_nodes_and_processes():
    spec = JobSpec(model="m", dataset=["d.jsonl"], nnodes=2, nproc_per_node=4)
    target, problems = slurm.SlurmTarget.for_job(spec, "gpu", extra=["qos=high", "--constraint=a100"])
    assert problems == [] and (target.nodes, target.cpus_per_task, target.python) == (2, 4, "python3")
    assert target.extra == ("--qos=high", "--constraint=a100")
    _, bad = slurm.SlurmTarget.for_job(None, "", time_limit="soon", extra=["wrap=rm"])
    assert {p.field for p in bad} == {"slurm.partition", "slurm.time_limit", "slurm.extra[0]"}


def test_the_pre_flight_inside_the_allocation_judges_every_nodes_report(tmp_path):
    """`probe` and `judge` as the batch script runs them: a node that cannot write its report (its
    run directory is not the shared one) lets the judge run, which fails it as shared_dir, and a
    node without the GPUs asked for fails it too, each named; each probe removes its own write-test
    token; the report is left for the studio; no node listed is an error, not a pass."""
    from backend.cluster import allocation
    from backend.cluster.preflight import TOKEN_DIR, allocation_params

    run_dir = tmp_path / "out" / "run-1"
    reports = allocation.report_dir(run_dir, 2)
    reports.mkdir(parents=True)
    (run_dir / "job.yaml").write_text(demo_spec(output_dir=str(tmp_path / "out")).to_yaml())
    (tmp_path / "out" / TOKEN_DIR).mkdir()
    (tmp_path / "out" / TOKEN_DIR / "another-run").write_text("x")  # not ours: left alone
    assert allocation.main(["probe", "--run-dir", str(run_dir), "--attempt", "2", "--token", "t-2",
                            "--node", "gpu-1"]) == 0
    probe = json.loads((reports / "gpu-1.json").read_text())
    assert probe["token_written"]
    assert sorted(p.name for p in (tmp_path / "out" / TOKEN_DIR).iterdir()) == ["another-run"]
    # gpu-2 sees another disk at the same path: no run directory there, no report written.
    elsewhere = tmp_path / "gpu-2-disk" / "run-1"
    assert allocation.main(["probe", "--run-dir", str(elsewhere), "--attempt", "2", "--token", "t-2",
                            "--node", "gpu-2"]) == 0
    assert not (tmp_path / "gpu-2-disk" / TOKEN_DIR).exists()
    assert allocation_params(str(tmp_path / "out"), "t-2", None)["output_dir"] == str(tmp_path / "out")

    code = allocation.main(["judge", "--run-dir", str(run_dir), "--attempt", "2", "--token", "t-2",
                            "--gpus-per-node", "8", "gpu-1", "gpu-2"])
    report = json.loads((reports / "report.json").read_text())
    errors = {(r["node"], r["check"]) for r in report["results"] if r["status"] == "error"}
    assert code == 3 and errors == {("gpu-1", "gpus"), ("gpu-2", "shared_dir")}, report

    assert allocation.main(["judge", "--run-dir", str(run_dir), "--attempt", "2", "--token", "t-2"]) == 3
    report = json.loads((reports / "report.json").read_text())
    assert [(r["node"], r["check"], r["status"]) for r in report["results"]] == [("allocation", "nodes", "error")]


def test_a_job_whose_pre_flight_failed_names_the_node_and_check(tmp_path):
    from backend.cluster import allocation

    (tmp_path / "logs").mkdir()
    (tmp_path / "logs/slurm-14.out").write_text(f"{slurm.PREFLIGHT_FAILED}\n")
    reports = allocation.report_dir(tmp_path, 1)
    reports.mkdir(parents=True)
    (reports / "report.json").write_text(json.dumps({"results": [
        {"node": "gpu-2", "check": "gpus", "status": "error", "reason": "0 GPU(s), the job needs 8", "fix": "check gres"},
        {"node": "gpu-1", "check": "disk", "status": "ok", "reason": "90 GiB free", "fix": ""}]}))
    out = _outcome(tmp_path, slurm.JobState("14", "FAILED", exit_code=3), [])
    assert out.failure.cause == "config_error", out.failure
    assert "gpu-2 gpus: 0 GPU(s), the job needs 8 (fix: check gres)" in out.failure.message
    (reports / "report.json").write_text("{crafted")  # unreadable: the pre-flight could not run
    assert _outcome(tmp_path, slurm.JobState("14", "FAILED", exit_code=3), []).failure.cause == "command_not_found"
