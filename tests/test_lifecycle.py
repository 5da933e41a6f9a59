"""Run state machine and its persistence (in-memory SQLite), run ids, watch's root-cause choice."""
from __future__ import annotations

import pytest

from backend import lifecycle as lc
from backend import logclass
from backend.db import create_db_and_tables, make_engine
from backend.manager import make_run_id
from backend.models import NodeProcess, Run
from backend.watch import choose_root, failure_from


@pytest.fixture
def store():
    engine = make_engine("sqlite://")
    create_db_and_tables(engine)
    s = lc.RunStore(engine)
    s.create(Run(id="r1", name="r1", spec_yaml="model: m\n", output_dir="/o", run_dir="/o/r1"))
    return s


def test_happy_path_and_attempts(store):
    store.transition("r1", lc.CHECKING)
    attempt = store.new_attempt("r1", [{"host": "a"}], None)
    for state in (lc.LAUNCHING, lc.RUNNING, lc.STOPPED):
        store.transition("r1", state)
    assert store.get("r1").ended_at is not None
    # a resume is a new attempt of the same run
    store.transition("r1", lc.CHECKING)
    second = store.new_attempt("r1", [{"host": "b"}], "latest")
    store.transition("r1", lc.LAUNCHING)
    store.add_process(NodeProcess(run_id="r1", attempt_id=second.id, node="b", node_rank=0, pgid=123))
    store.transition("r1", lc.RUNNING)
    store.transition("r1", lc.FAILED, lc.Failure("b", 1, "killed", "killed (node b)", "tail"))
    run = store.get("r1")
    assert run.attempts == 2 and run.failed_node == "b" and run.cause == "killed" and run.log_tail == "tail"
    assert [(a.number, a.state, a.resume_from) for a in store.attempts("r1")] == [(1, "stopped", None), (2, "failed", "latest")]
    assert attempt.id != second.id and store.processes(second.id)[0].pgid == 123
    # a new attempt clears the previous failure from the run
    store.transition("r1", lc.CHECKING)
    assert store.get("r1").failed_node is None


@pytest.mark.parametrize("path", [[lc.RUNNING], [lc.CHECKING, lc.RUNNING], [lc.CHECKING, lc.LAUNCHING, lc.RUNNING,
                                                                          lc.SUCCEEDED, lc.CHECKING]])
def test_illegal_moves_are_refused(store, path):
    for state in path[:-1]:
        store.transition("r1", state)
    with pytest.raises(lc.TransitionError):
        store.transition("r1", path[-1])


def test_run_ids():
    assert make_run_id("my run; $(rm -rf /)", lambda _: False) == "my-run-rm--rf"
    taken = {"exp"}
    rid = make_run_id("exp", lambda r: r in taken)
    assert rid.startswith("exp-") and len(rid) == len("exp-") + 6
    auto = make_run_id(None, lambda _: False)
    assert len(auto) == len("20261130-040000-abcdef") and auto[8] == "-"


def test_root_cause_prefers_the_node_that_started_it():
    killed = failure_from("b", 1, ["  traceback : Signal 9 (SIGKILL) received by PID 42"])
    peer = failure_from("a", 1, ["[rank0]: RuntimeError: Connection closed by peer [127.0.0.3]:1234"])
    # the consequence (a) ended first, but the kill on b is the cause
    root = choose_root([(peer[0], peer[1], 100.0), (killed[0], killed[1], 101.0)])
    assert root.node == "b" and root.cause == logclass.KILLED and "node b" in root.message


def test_a_group_gone_without_exit_code_is_killed():
    cause, failure = failure_from("c", None, [])
    assert failure.cause == logclass.KILLED and failure.exit_code is None
