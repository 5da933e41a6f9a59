"""The suite's own layout: scripts/test.sh's two xdist workers share it by tests/xdist_units.py;
the worker tests' ranks are forked by tests/forkrun.py."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from xdist_units import BROWSER_FILES, LONGEST_FIRST, unit_rank, work_unit

HERE = Path(__file__).parent


def test_every_file_named_exists():
    named = BROWSER_FILES | {name for name in LONGEST_FIRST if name != "browser"}
    assert sorted(name for name in named if not (HERE / name).is_file()) == []


def test_the_browser_files_are_one_unit_and_every_other_file_its_own():
    assert work_unit("tests/test_startup.py::test_x[a::b]") == work_unit("tests/test_ui_flow.py::test_y") == "browser"
    assert work_unit("tests/test_spec.py::test_z[x@y]") == "tests/test_spec.py"
    assert work_unit("tests/test_spec.py::Class::test_z@test_spec") == "tests/test_spec.py"  # an older xdist's suffix
    assert unit_rank("tests/test_ui_flow.py::t") < unit_rank("tests/test_recovery.py::t") < unit_rank("tests/test_spec.py::t")


def test_two_workers_run_each_unit_whole_the_longest_first(tmp_path):
    """A real `pytest -n 2 --dist loadgroup` over files named like the suite's: each test records
    the worker it ran on. Under xdist's own loadgroup with pytest 9.2 the tests of one file were
    spread over both workers; under its ordering by number of tests the five-test file went first."""
    files = {"test_alpha.py": 5, "test_ui_flow.py": 2, "test_startup.py": 2, "test_recovery.py": 2, "test_beta.py": 3}
    for name, count in files.items():
        (tmp_path / name).write_text(
            "import os, pathlib, pytest\n"
            f"@pytest.mark.parametrize('i', range({count}))\n"
            "def test_it(i):\n"
            "    with open(pathlib.Path(__file__).parent / 'ran.txt', 'a') as f:\n"
            "        f.write(f\"{os.environ['PYTEST_XDIST_WORKER']} {pathlib.Path(__file__).name} {i}\\n\")\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-p", "xdist_units",
                           "-p", "no:cacheprovider", "-q", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": str(HERE), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    ran = [line.split() for line in (tmp_path / "ran.txt").read_text().splitlines()]
    assert len(ran) == sum(files.values())
    workers, first = {}, {}
    for worker, name, _ in ran:
        workers.setdefault(work_unit(name), set()).add(worker)
        first.setdefault(worker, work_unit(name))
    assert all(len(w) == 1 for w in workers.values()), workers
    assert sorted(first.values()) == ["browser", "test_recovery.py"], first  # both workers had work, longest first
    browser = [(name, int(i)) for _, name, i in ran if name in BROWSER_FILES]
    assert browser == sorted(browser)  # one after another, in file order


def test_run_workers_keeps_the_ranks_in_flight_within_the_cores_and_times_each_run_from_its_start(tmp_path):
    """Launches of RANK_SLOTS ranks each run one after another, in order; a run past its own timeout
    is killed, and the runs after it still start."""
    import time

    from worker import RANK_SLOTS, run_workers

    def launch(name: str, seconds: float) -> dict:
        script = f"import time; open({str(tmp_path / name)!r}, 'w').write(f'{{time.time()}} '); time.sleep({seconds}); " \
                 f"open({str(tmp_path / name)!r}, 'a').write(f'{{time.time()}}')"
        return dict(run_dir=tmp_path / f"run-{name}", argv=[sys.executable, "-c", script], nproc=RANK_SLOTS)

    started = time.monotonic()
    first, second, third = run_workers([launch("a", 0.3), launch("b", 30), launch("c", 0.3)], timeout=3)
    assert time.monotonic() - started < 20
    assert first.returncode == 0 and third.returncode == 0 and second.returncode != 0
    a, c = ([float(t) for t in (tmp_path / n).read_text().split()] for n in "ac")
    b_start = float((tmp_path / "b").read_text().split()[0])
    assert a[1] <= b_start and b_start + 3 <= c[0] + 0.5  # b began after a ended; c after b was stopped


def test_only_the_workers_torchrun_is_forked():
    """tests/forkrun.py takes torchrun's place for the worker (`-m launcher.train`), its options
    kept; a script or another module is started by torchrun itself (a forked rank that returns
    outlives its process until every rank has: tests/forkrun.py)."""
    from pathlib import Path

    from worker import FORKRUN, forked, torchrun, torchrun_argv

    worker = torchrun_argv(Path("/runs/a"), 2, resume="latest")
    assert forked(worker) == [sys.executable, str(FORKRUN), *worker[3:]]
    assert worker[3:][-6:] == ["-m", "launcher.train", "--run-dir", "/runs/a", "--resume", "latest"]
    for other in (torchrun(2, "probe.py", "launcher.train"), torchrun(2, "-m", "backend.cluster.bwtest"),
                  [sys.executable, "-c", "print()"]):
        assert forked(other) == other


def test_a_launch_shares_the_forkserver_unless_what_its_imports_read_differs():
    """A shared forkserver's ranks imported in its environment: a launch whose import-time
    variables differ (the video tests' PYTHONPATH) needs another forkserver, shared by the launches
    of that environment; one that differs in what the ranks read later (from their agent) does not."""
    from worker import import_env, worker_env

    env = worker_env()
    assert import_env({**env, "MASTER_ADDR": "127.0.0.9", "MLFLOW_ALLOW_FILE_STORE": "true"}) == import_env(env)
    for key, value in (("PYTHONPATH", "/elsewhere"), ("HF_HOME", "/h"), ("OMP_NUM_THREADS", "4"),
                       ("TRANSFORMERS_VERBOSITY", "info")):
        assert import_env({**env, key: value}) != import_env(env), key


def test_launches_of_one_import_environment_share_a_forkserver_and_the_oldest_is_let_go(monkeypatch):
    """One forkserver per import environment; past MAX_FORKSERVERS the test process closes its end
    of the oldest's alive pipe, so that server ends once the ranks it forked have."""
    import worker

    started = []

    def start_server(env, cwd):
        alive_r, alive_w = os.pipe()
        started.append((env["HF_HOME"], alive_r))
        return None, f"/sockets/{len(started)}:{alive_w}"

    monkeypatch.setattr(worker, "_FORKSERVERS", {})
    monkeypatch.setattr(worker, "start_server", start_server)
    env = worker.worker_env()
    first = worker.shared_forkserver({**env, "HF_HOME": "/h0"})
    assert worker.shared_forkserver({**env, "HF_HOME": "/h0", "MASTER_PORT": "1"}) == first
    for n in range(1, worker.MAX_FORKSERVERS + 1):
        worker.shared_forkserver({**env, "HF_HOME": f"/h{n}"})
    assert [home for home, _ in started] == [f"/h{n}" for n in range(worker.MAX_FORKSERVERS + 1)]
    os.set_blocking(started[0][1], False)  # a writer left would raise BlockingIOError, not hang
    assert os.read(started[0][1], 1) == b""  # the oldest's alive pipe: no writer left
    assert worker.shared_forkserver({**env, "HF_HOME": "/h0"}) != first  # started again
    for _, alive_r in started:
        os.close(alive_r)
    for named, _ in worker._FORKSERVERS.values():
        os.close(worker.alive_fd(named))


RANK_MODULE = '''
import os, sys, time
import forkrun
from launcher.leave import leave
rank = int(os.environ["RANK"])
missing = [m for m in forkrun.PRELOAD if m not in sys.modules]
print(f"rank {rank} of {os.environ['WORLD_SIZE']} run {os.environ['TORCHELASTIC_RUN_ID']} argv {sys.argv[1:]} "
      f"missing {missing} agent's {os.environ.get('AGENT_ONLY')} cwd {os.getcwd()}")
with open(os.path.join(os.getcwd(), f"pid-{rank}"), "w") as f:
    f.write(str(os.getpid()))
if sys.argv[1] == "sleep":
    time.sleep(300)
leave(int(sys.argv[1]) if rank == 1 else 0)
'''


def forkrun_argv(*args: str) -> list[str]:
    from worker import FORKRUN, torchrun

    return [sys.executable, str(FORKRUN), *torchrun(2, "--rdzv_id", "r1", "-m", "rank_module", *args)[3:]]


def rank_env(tmp_path: Path, shared: bool) -> tuple[dict, tuple, subprocess.Popen | None]:
    """The agent's environment (a variable the forkserver lacks, rank_module on its path), its
    pass_fds, and the shared forkserver, where `shared`."""
    from worker import FORKSERVER_ENV, ROOT, alive_fd, start_server, worker_env

    (tmp_path / "rank_module.py").write_text(RANK_MODULE)
    env = worker_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(HERE), env["PYTHONPATH"]])
    if not shared:
        return {**env, "AGENT_ONLY": "yes"}, (), None
    server, named = start_server(env, str(ROOT))
    return {**env, "AGENT_ONLY": "yes", FORKSERVER_ENV: named}, (alive_fd(named),), server


def close_server(server: subprocess.Popen, pass_fds: tuple) -> None:
    """The shared forkserver ends once its last holder of the alive pipe, here the test, closes it."""
    os.close(pass_fds[0])
    assert server.wait(timeout=30) == 0


@pytest.mark.e2e
@pytest.mark.parametrize("shared", [False, True], ids=["own-forkserver", "shared-forkserver"])
@pytest.mark.parametrize("code", [0, 7])
def test_forked_ranks_get_torchruns_environment_and_end_with_their_exit_code(tmp_path, code, shared):
    """Each rank of tests/forkrun.py starts with the forkserver's imports (PRELOAD: a name that no
    longer imports would be passed over without a word, and every rank would import it again), gets
    torchrun's environment and its arguments, writes its lines unbuffered, and ends with the code
    it leaves with: torchrun then fails, naming it. From a forkserver shared with other launches
    too: its ranks take the agent's environment, directory and output, not the server's."""
    env, pass_fds, server = rank_env(tmp_path, shared)
    done = subprocess.run(forkrun_argv(str(code)), env=env, cwd=tmp_path, pass_fds=pass_fds, capture_output=True,
                          text=True, timeout=120)
    out = done.stdout + done.stderr
    for rank in (0, 1):
        assert f"rank {rank} of 2 run r1 argv ['{code}'] missing [] agent's yes cwd {tmp_path}" in out, out[-3000:]
    assert done.returncode == (1 if code else 0), out[-3000:]
    assert (f"exitcode: {code}" in out) == bool(code), out[-3000:]
    if server:
        close_server(server, pass_fds)


@pytest.mark.e2e
def test_the_ranks_of_a_shared_forkserver_end_with_their_agent(tmp_path):
    """The shared forkserver's ranks are no descendants of their agent: killed (a test's timeout,
    kill_tree), it takes them with it as it would its own children."""
    import psutil

    env, pass_fds, server = rank_env(tmp_path, shared=True)
    agent = subprocess.Popen(forkrun_argv("sleep"), env=env, cwd=tmp_path, pass_fds=pass_fds,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"pid-{rank}").is_file() for rank in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.2)
    ranks = [psutil.Process(int((tmp_path / f"pid-{rank}").read_text())) for rank in (0, 1)]
    assert not {r.pid for r in ranks} & {c.pid for c in psutil.Process(agent.pid).children(recursive=True)}
    agent.kill()
    agent.wait()
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive, alive
    close_server(server, pass_fds)
