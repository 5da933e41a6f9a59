"""Run state machine and its persistence (compare-and-set transitions, owners, migration of an older
database), run ids, watch's root-cause choice."""
from __future__ import annotations

import threading

import pytest
from sqlalchemy import inspect, text

from backend.runs import lifecycle as lc
from backend.runs.manager import make_run_id
from backend.runs.watch import choose_root, failure_from
from backend.store.db import create_db_and_tables, make_engine
from backend.store.models import NodeProcess, Run
from backend.telemetry import logclass


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


def test_notices_are_stored_for_every_process(tmp_path):
    """A run's notices (automatic recovery's decisions among them) are read by any process, the
    last ones oldest first."""
    url = f"sqlite:///{tmp_path / 'studio.db'}"
    writer, reader = (lc.RunStore(make_engine(url)) for _ in range(2))
    create_db_and_tables(writer.engine)
    for run_id in ("r1", "r2"):
        writer.create(Run(id=run_id, name=run_id, spec_yaml="model: m\n", output_dir="/o", run_dir=f"/o/{run_id}"))
    for n in range(25):
        writer.add_notice("r1", f"notice {n}")
    writer.add_notice("r2", "another run's")
    assert [n.message for n in reader.notices("r1", 3)] == ["notice 22", "notice 23", "notice 24"]
    assert len(reader.notices("r1", 100)) == 25 and [n.message for n in reader.notices("r2", 3)] == ["another run's"]


def test_a_notice_the_database_refuses_is_logged_not_raised(caplog):
    """The watches report a failing database through notices: that report must not end them."""
    from sqlalchemy.exc import OperationalError

    from backend.runs.driver import AttemptDriver

    class Refusing:
        def add_notice(self, run_id, message):
            raise OperationalError("INSERT INTO runnotice", {}, Exception("database is locked"))

    AttemptDriver(Refusing(), None, None, None, None, None, None).notice("r1", "telemetry from a could not be stored")
    assert "notice not stored: telemetry from a could not be stored" in caplog.text


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
    # Always a name Slurm takes as a job name: a letter or digit first, 64 characters at most.
    from backend.cluster.slurm import _NAME
    for name, others in (("_exp", set()), ("x" * 70, set()), ("y" * 64, {"y" * 64})):
        rid = make_run_id(name, lambda r: r in others)
        assert _NAME.match(rid) and rid not in others, rid
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


@pytest.fixture
def shared(tmp_path):
    """A database file, as the studio and CLI processes share it."""
    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    create_db_and_tables(engine)
    yield lc.RunStore(engine)
    engine.dispose()


def running(store, run_id: str, by: lc.Owner | None = None) -> None:
    store.create(Run(id=run_id, name=run_id, spec_yaml="model: m\n", output_dir="/o", run_dir=f"/o/{run_id}"))
    store.transition(run_id, lc.CHECKING, by=by)
    store.new_attempt(run_id, [{"host": "a"}], None)
    store.transition(run_id, lc.LAUNCHING, by=by)
    store.transition(run_id, lc.RUNNING, by=by)


def test_concurrent_transitions_exactly_one_wins(shared):
    for i in range(10):
        run_id = f"r{i}"
        running(shared, run_id)
        ends = (lc.SUCCEEDED, lc.FAILED, lc.STOPPED) * 2
        barrier, won, lost = threading.Barrier(len(ends)), [], []

        def move(state):
            barrier.wait()
            try:
                shared.transition(run_id, state, lc.Failure(None, None, state, f"by {state}"))
                won.append(state)
            except lc.TransitionError as exc:
                lost.append(str(exc))

        threads = [threading.Thread(target=move, args=(s,)) for s in ends]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1 and len(lost) == len(ends) - 1, (won, lost)
        run, [attempt] = shared.get(run_id), shared.attempts(run_id)
        # the winner's record, not a mix of the losers' fields written over it
        assert run.state == attempt.state == won[0] and run.message == attempt.message == f"by {won[0]}"
        assert all(f"run {run_id} changed while moving it from running" in m or "cannot go from" in m for m in lost)


def test_only_the_owner_moves_its_run_and_a_stop_is_anyones(shared):
    a, b = lc.Owner("h", 1, "a"), lc.Owner("h", 2, "b")
    running(shared, "r1", by=a)
    with pytest.raises(lc.TransitionError, match="driven by h:1:a"):
        shared.transition("r1", lc.FAILED, lc.Failure(None, None, "interrupted", "b thinks a is gone"), by=b)
    assert (shared.get("r1").state, shared.get("r1").cause) == (lc.RUNNING, None)
    shared.transition("r1", lc.STOPPED)  # the user's stop, from any process
    # a resume makes whoever starts it the owner
    shared.transition("r1", lc.CHECKING, by=b)
    assert shared.get("r1").owner == b.id


def test_of_two_managers_adopting_an_orphan_one_wins(shared):
    gone = lc.Owner("h", 1, "x")
    running(shared, "r1", by=gone)
    seen = shared.get("r1")
    a, b = lc.Owner("h", 2, "a"), lc.Owner("h", 3, "b")
    assert shared.claim(seen, a, now=100.0)
    assert not shared.claim(seen, b, now=100.0)  # it no longer looks as b saw it
    assert shared.get("r1").owner == a.id
    shared.heartbeat(a, 200.0)
    assert shared.get("r1").heartbeat_at == 200.0
    shared.release(a)
    assert (shared.get("r1").owner, shared.get("r1").heartbeat_at) == (None, None)


@pytest.mark.parametrize("owner,beat_age,alive,gone", [
    (None, 0.0, True, True),                                      # nobody ever drove it (or it was released)
    ("here:10:t", 1.0, True, False),                              # a live owner that beats
    ("here:10:t", 1.0, False, True),                              # its process on this host is gone: at once
    ("there:10:t", 1.0, False, False),                            # a pid means nothing for another host
    ("there:10:t", lc.OWNER_TIMEOUT_S + 0.1, True, True),         # silent for too long
])
def test_owner_gone(owner, beat_age, alive, gone):
    run = Run(id="r", name="r", spec_yaml="", output_dir="/o", run_dir="/o/r", owner=owner, heartbeat_at=1000.0)
    assert lc.owner_gone(run, 1000.0 + beat_age, "here", lambda pid: alive) is gone


NEW_COLUMNS = {"run": ("owner", "heartbeat_at"), "telemetry_sample": ("attempt",),
               "telemetry_event": ("step", "attempt")}


def test_an_older_database_gets_the_new_columns(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = make_engine(url)
    create_db_and_tables(engine)
    with engine.begin() as conn:  # the tables as an older version made them, with a run in them
        conn.execute(text("DROP INDEX ix_telemetry_event_run_type_t"))
        for table, columns in NEW_COLUMNS.items():
            for column in columns:
                conn.execute(text(f"ALTER TABLE {table} DROP COLUMN {column}"))
        conn.execute(text("INSERT INTO run (id, name, state, spec_yaml, output_dir, run_dir, attempts, "
                          "stop_requested, created_at, updated_at) "
                          "VALUES ('old', 'old', 'failed', 'model: m', '/o', '/o/old', 1, 0, 1, 1)"))
    engine.dispose()
    for _ in range(2):  # idempotent
        engine = make_engine(url)
        create_db_and_tables(engine)
        present = {t: {c["name"] for c in inspect(engine).get_columns(t)} for t in NEW_COLUMNS}
        assert all(set(cols) <= present[t] for t, cols in NEW_COLUMNS.items()), present
        assert "ix_telemetry_event_run_type_t" in {i["name"] for i in inspect(engine).get_indexes("telemetry_event")}
        run = lc.RunStore(engine).get("old")
        assert (run.state, run.owner) == ("failed", None)
        engine.dispose()
