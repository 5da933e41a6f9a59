"""The collective timeout follows the measured step time: the limit (backend.job.limits), torch's
private call that changes a process group's timeout (pinned), and a real worker whose peer stops
ending itself within that limit instead of ddp_timeout."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from backend.job.limits import COLLECTIVE_MARGIN_S, collective_timeout_s, hang_limit_s
from backend.job.spec import JobSpec
from backend.telemetry import logclass

DEMO = "assets/demo/train.jsonl"


def spec(**fields) -> JobSpec:
    return JobSpec(model="m", dataset=["d.jsonl"], **fields)


def test_the_hang_limit_is_a_multiple_of_the_median_interval_with_a_floor():
    assert hang_limit_s(300, 5, []) == 300
    assert hang_limit_s(300, 5, [10, 100, 20]) == 300  # 5 x 20 s is under the floor
    assert hang_limit_s(30, 5, [10, 100, 20, 0]) == 100  # zero gaps (two events at once) do not count
    assert hang_limit_s(30, 5, [10, 12, 11, 400]) == pytest.approx(5 * 11.5)  # one slow step does not move it


def test_the_collective_timeout_is_twice_the_hang_limit_over_logged_steps_and_at_most_ddp_timeout():
    # Steps of 2 s, logged every 5: 10 s between logged steps, 5 x 10 = 50 s over the 30 s floor.
    assert collective_timeout_s(spec(hang_timeout_s=30, logging_steps=5), [2.0] * 10) == 100
    # A fast run keeps the floor and the margin: 300 s floor -> 600 s (not the 1800 s default).
    assert collective_timeout_s(spec(), [0.1] * 10) == 600
    assert collective_timeout_s(spec(hang_timeout_s=5, logging_steps=1), [0.1]) == 5 + COLLECTIVE_MARGIN_S
    assert collective_timeout_s(spec(ddp_timeout=120), [0.1] * 10) == 120
    assert collective_timeout_s(spec(hang_timeout_s=30, logging_steps=5), []) == 30 + COLLECTIVE_MARGIN_S


SHORTENED = '''
import time
import torch, torch.distributed as dist
from launcher import dist as ld

ctx = ld.init(600)
mesh_group = dist.new_group(ranks=[0, 1])  # like an engine's mesh group, made before the change
ctx.set_collective_timeout(2)
if ctx.rank == 1:
    time.sleep(8)  # rank 0 waits in its collectives, longer than the new limit
    report("slept")
else:
    started = time.monotonic()
    works = {name: dist.all_reduce(torch.ones(1), group=group, async_op=True)
             for name, group in (("world", None), ("control", ctx.control), ("mesh", mesh_group))}
    outcome = []
    for name, work in works.items():
        try:
            work.wait()
            outcome.append(f"{name} no timeout")
        except RuntimeError as exc:
            outcome.append(f"{name} {time.monotonic() - started:.1f} {str(exc).splitlines()[0]}")
    report("\\n".join(outcome))
'''


def test_torch_private_set_pg_timeout_shortens_every_group_already_made(tmp_path):
    """Pins torch's `_set_pg_timeout` (no public API): groups made with 600 s time out after the
    2 s set later, the world, the control and an engine's group alike."""
    from worker import probe_ranks

    outcomes, log = probe_ranks(tmp_path, 2, SHORTENED)
    assert outcomes[1:] == ["slept"], log[-3000:]
    lines = outcomes[0].splitlines()
    assert [line.split()[0] for line in lines] == ["world", "control", "mesh"], lines
    for line in lines:
        assert float(line.split()[1]) < 5, lines
        assert logclass.classify_error("RuntimeError", line).kind == logclass.NCCL_TIMEOUT, line


@pytest.mark.e2e
def test_a_worker_whose_peer_stops_ends_at_the_step_time_limit_not_ddp_timeout(tmp_path, tiny_model, capsys):
    from worker import kill_tree, torchrun_argv, worker_env, write_run

    run = write_run(tmp_path / "run", model=str(tiny_model), dataset=[DEMO], max_length=32, max_steps=100000,
                    logging_steps=1, save_strategy="no", ddp_timeout=1800, hang_timeout_s=5, hang_step_multiple=1)
    (run / "logs").mkdir()
    events = run / "events"
    with open(run / "logs" / "local.log", "w") as log:
        proc = subprocess.Popen(torchrun_argv(run, 2), cwd=os.getcwd(), env=worker_env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def rank0(kind: str) -> list[dict]:
            path = events / "rank-0.jsonl"
            complete = path.read_text().split("\n")[:-1] if path.exists() else []  # the last may be half written
            return [e for e in map(json.loads, complete) if e.get("type") == kind]

        deadline = time.monotonic() + 120
        while not rank0("collective_timeout") and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        tuned = rank0("collective_timeout")
        assert tuned, (run / "logs" / "local.log").read_text()[-3000:]
        limit = tuned[-1]["timeout_s"]
        assert limit == 5 + COLLECTIVE_MARGIN_S, tuned
        os.kill(rank0("start")[0]["attempt_pid"], signal.SIGSTOP)
        stopped = time.monotonic()
        def ended() -> str:  # the end slot, all spaces until the rank ends
            path = events / "rank-1.end"
            return path.read_text().strip() if path.exists() else ""

        while not ended() and time.monotonic() < stopped + limit + 60:
            time.sleep(0.2)
        waited = time.monotonic() - stopped
        assert ended(), (run / "logs" / "local.log").read_text()[-3000:]
        slot = json.loads(ended())
        with capsys.disabled():
            print(f"\ncollective timeout: a rank stopped with SIGSTOP, its peer failed {waited:.1f} s later "
                  f"(collective timeout {limit:.0f} s from the step time, ddp_timeout 1800 s)")
        assert slot["status"] == "failed" and limit - 10 < waited < limit + 20, (waited, slot)
        assert logclass.classify_end(slot).kind == logclass.NCCL_TIMEOUT, slot["error"]
    finally:
        kill_tree(proc)
