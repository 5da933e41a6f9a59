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
        (tmp_path / REQUEST).write_text("r@1\n")
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
    assert {a["request"] for a in answers.values()} == {"r@1"} and answers[0]["group"] in answers[1]["groups"]
    assert json.loads((tmp_path / dump_file(0)).read_text())["rank"] == 0
    w = alerts.Window(now=now + 30, running=True, started_t=now - 60,
                      train=[{"type": "train", "step": 2, "time": now - 40}], flights=answers,
                      rank_seen={0: now - 59, 1: now - 59}, placement={0: ("a", None), 1: ("b", None)},
                      flight_request="r@1")
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


def test_asking_is_bounded_by_a_hung_node_and_a_step_meanwhile_is_no_hang(monkeypatch):
    """The watch's request: a node whose shell hangs (its run directory on a hung mount) costs
    PROBE_TIMEOUT_S, not the stop; the answers are awaited with the request's token; and a hang
    rule that no longer fires after the wait (a step came) means the attempt is not stopped."""
    import asyncio

    from backend.cluster import launch
    from backend.job.cluster import Node
    from backend.runs import watch

    written, asked = [], []

    async def write_files(pool, node, setup, run_dir, files):
        if node.host == "stuck":
            await asyncio.sleep(3600)
        written.append((node.host, files[REQUEST]))

    class Sink:
        def __init__(self, hang):
            self._hang = hang

        def awaiting_flight(self, run_id, request):
            asked.append(request)
            return len(asked) < 3

        def hang(self, run_id, since):
            return self._hang

    monkeypatch.setattr(launch, "write_files", write_files)
    monkeypatch.setattr(watch, "PROBE_TIMEOUT_S", 0.2)
    nodes = [(Node(host="stuck", slots=1), None), (Node(host="ok", slots=1), None)]
    finding = alerts.Finding("hang", "hang:3", "error", 0.0, "no training step for 11 s")
    started = time.monotonic()
    assert asyncio.run(watch.ask_flight_recorders(None, nodes, "/r", Sink(None), "run", 0.0, finding)) is None
    assert time.monotonic() - started < 5
    [(host, request)] = written
    assert host == "ok" and asked == [request.strip()] * 3  # awaited until the answers came
    again = asyncio.run(watch.ask_flight_recorders(None, nodes, "/r", Sink(finding), "run", 0.0, finding))
    assert again is finding
    asked.clear()
    assert asyncio.run(watch.ask_flight_recorders(None, nodes[:1], "/r", Sink(None), "run", 0.0, finding)) is finding
    assert asked == []  # no request written anywhere: stopped on what was known, without waiting


def test_a_crafted_request_or_a_planted_link_is_neither_followed_nor_blocks_the_rank(tmp_path, caplog):
    """The run directory is written by other processes: links planted under the names a dump could
    be written through are not followed (its temporary name is fresh and made exclusively), and a
    request that is a FIFO (a plain open would block) or a giant file is refused, with a warning,
    by a thread that goes on answering."""
    from launcher import flight

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "flight").mkdir()
    for name in (dump_file(0) + ".tmp", f".{Path(dump_file(0)).name}.tmp"):
        (tmp_path / name).symlink_to(victim)
    thread = flight.answer_requests(tmp_path, 0, poll_s=0.05)
    request = tmp_path / REQUEST
    dump = tmp_path / dump_file(0)

    def warned(times: int) -> None:
        deadline = time.time() + 10
        while caplog.text.count("flight recorder dump failed") < times:
            assert time.time() < deadline, caplog.text
            time.sleep(0.05)

    def answered(token: str) -> None:
        deadline = time.time() + 10
        while not dump.exists() or json.loads(dump.read_text())["request"] != token:
            assert time.time() < deadline
            time.sleep(0.05)

    request.write_text("r@1\n")
    answered("r@1")
    assert victim.read_text() == "keep me" and not dump.is_symlink()
    request.unlink()
    os.mkfifo(request)
    warned(1)
    assert "not a regular file" in caplog.text
    request.unlink()
    request.write_bytes(b"x" * 10_000)
    warned(2)
    assert "larger than 200 bytes" in caplog.text and thread.is_alive()
    time.sleep(0.1)
    # Written whole, as the watch writes it (write_files renames into place): a plain write_text
    # can be read between its truncation and its write, and answered as an empty request.
    (tmp_path / "request.new").write_text("r@2\n")
    os.replace(tmp_path / "request.new", request)
    answered("r@2")
    assert victim.read_text() == "keep me"
