"""The suite's own layout: scripts/test.sh's two xdist workers share it by tests/xdist_units.py."""
import subprocess
import sys
from pathlib import Path

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
