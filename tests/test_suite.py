"""The suite's own layout: scripts/test.sh's two xdist workers share it by tests/xdist_units.py."""
import subprocess
import sys
from pathlib import Path

from xdist_units import SERVICE_FILES, work_unit

HERE = Path(__file__).parent


def test_every_service_file_exists():
    assert sorted(name for name in SERVICE_FILES if not (HERE / name).is_file()) == []


def test_the_service_files_are_one_unit_and_every_other_file_its_own():
    assert work_unit("tests/test_agent.py::test_x[a::b]") == work_unit("tests/test_ui_flow.py::test_y") == "services"
    assert work_unit("tests/test_spec.py::test_z[x@y]") == "tests/test_spec.py"
    assert work_unit("tests/test_spec.py::Class::test_z@test_spec") == "tests/test_spec.py"  # an older xdist's suffix


def test_two_workers_run_each_unit_whole_and_in_order(tmp_path):
    """A real `pytest -n 2 --dist loadgroup` over files named like the suite's: each test records
    the worker it ran on. Under xdist's own loadgroup with pytest 9.2 the tests of one file were
    spread over both workers."""
    files = ("test_agent.py", "test_ui_flow.py", "test_alpha.py", "test_beta.py", "test_gamma.py")
    assert {"test_agent.py", "test_ui_flow.py"} <= SERVICE_FILES
    for name in files:
        (tmp_path / name).write_text(
            "import os, pathlib, pytest\n"
            "@pytest.mark.parametrize('i', range(4))\n"
            "def test_it(i):\n"
            "    with open(pathlib.Path(__file__).parent / 'ran.txt', 'a') as f:\n"
            "        f.write(f\"{os.environ['PYTEST_XDIST_WORKER']} {pathlib.Path(__file__).name} {i}\\n\")\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-p", "xdist_units",
                           "-p", "no:cacheprovider", "-q", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": str(HERE), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    ran = [line.split() for line in (tmp_path / "ran.txt").read_text().splitlines()]
    assert len(ran) == 4 * len(files)
    workers = {}
    for worker, name, _ in ran:
        workers.setdefault(work_unit(name), set()).add(worker)
    assert all(len(w) == 1 for w in workers.values()), workers
    assert len(set().union(*workers.values())) == 2  # both workers had work
    services = [(name, int(i)) for _, name, i in ran if name in SERVICE_FILES]
    assert services == sorted(services)  # one after another, in collection order
