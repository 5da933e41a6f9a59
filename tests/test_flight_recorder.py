"""The flight recorder on a hang, with real gloo ranks: PyTorch records each rank's collectives;
on the watch's request (`backend.job.flight`) each rank that can run Python writes its recorder
(`launcher.flight`), the agent reads the file, and the hang rule names the collective the ranks
wait in and the rank that never entered it."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from backend.job.flight import REQUEST, dump_file
from backend.telemetry import alerts
from backend.telemetry.agent import requested_flight_record

REPO = Path(__file__).resolve().parent.parent

# Rank 1 never enters the third all_reduce (it sleeps in Python, as a rank busy with its data or a
# loop would); rank 0 waits in it. Each answers the request from its flight recorder thread.
RANKS = r"""
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from launcher import flight
run_dir, rank = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", init_method="file://" + os.path.join(run_dir, "store"), rank=rank, world_size=2,
                        timeout=timedelta(seconds=60))
flight.answer_requests(run_dir, rank, poll_s=0.2)
t = torch.ones(4)
for _ in range(2):
    dist.all_reduce(t)
open(os.path.join(run_dir, f"ready-{rank}"), "w").close()
if rank == 1:
    time.sleep(60)
dist.all_reduce(t)
"""


def test_a_rank_waiting_in_a_collective_and_the_rank_that_never_entered_it(tmp_path):
    import subprocess

    # An old request (an earlier attempt's) is not answered.
    (tmp_path / REQUEST).parent.mkdir()
    (tmp_path / REQUEST).write_text("old\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("TORCH_FR_BUFFER_SIZE", None)  # the recorder is on by default
    ranks = [subprocess.Popen([sys.executable, "-c", RANKS, str(tmp_path), str(r)], env=env) for r in (0, 1)]
    try:
        deadline = time.time() + 90
        while not all((tmp_path / f"ready-{r}").exists() for r in (0, 1)):
            assert time.time() < deadline and all(p.poll() is None for p in ranks), "the ranks did not start"
            time.sleep(0.1)
        time.sleep(1.0)
        assert not any((tmp_path / dump_file(r)).exists() for r in (0, 1))
        (tmp_path / REQUEST).write_text(f"{time.time()}\n")
        while not all((tmp_path / dump_file(r)).exists() for r in (0, 1)):
            assert time.time() < deadline, "no dump within the wait"
            time.sleep(0.1)
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    now = time.time()
    answers = {r: requested_flight_record(tmp_path / dump_file(r), r, now) for r in (0, 1)}
    assert (answers[0]["collective"], answers[0]["seq"], answers[0]["in_flight"]) == ("gloo:all_reduce", 3, True)
    assert answers[1]["in_flight"] is False and answers[1]["last_seq"] == {answers[0]["group"]: 2}
    assert json.loads((tmp_path / dump_file(0)).read_text())["rank"] == 0
    w = alerts.Window(now=now + 30, running=True, started_t=now - 60,
                      train=[{"type": "train", "step": 2, "time": now - 40}], flights=answers,
                      rank_seen={0: now - 59, 1: now - 59}, placement={0: ("a", None), 1: ("b", None)})
    [hang] = alerts.hang(w, alerts.AlertConfig(hang_s=10))
    assert "flight recorder: rank 0 waits in gloo:all_reduce #3 (process group default_pg)" in hang.message
    assert "rank 1 never entered it (its last collective there: #2)" in hang.message
    assert (hang.rank, hang.node) == (1, "b")


def test_a_failed_dump_is_logged_and_the_next_request_answered(tmp_path, caplog):
    """The dump thread must never end a rank: a dump it cannot write is a warning."""
    from launcher import flight

    (tmp_path / dump_file(0)).mkdir(parents=True)  # the dump cannot replace a directory
    thread = flight.answer_requests(tmp_path, 0, poll_s=0.05)
    (tmp_path / REQUEST).write_text("1\n")
    deadline = time.time() + 10
    while "flight recorder dump failed" not in caplog.text:
        assert time.time() < deadline, caplog.text
        time.sleep(0.05)
    assert thread.is_alive()
    (tmp_path / dump_file(0)).rmdir()
    time.sleep(0.1)
    (tmp_path / REQUEST).write_text("2\n")
    while not (tmp_path / dump_file(0)).exists():
        assert time.time() < deadline
        time.sleep(0.05)
    assert "_dump_fr_trace_json" in json.loads((tmp_path / dump_file(0)).read_text())["dumps"]
