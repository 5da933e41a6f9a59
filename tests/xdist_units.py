"""How scripts/test.sh's two xdist workers share the suite (a pytest plugin; conftest imports its hooks)."""
from __future__ import annotations

from pathlib import Path

# scripts/test.sh runs two xdist workers (--dist loadgroup). A worker takes a whole file at a time,
# so a module's fixtures are built once. The files that drive a browser (the Slurm file's studio
# too) are one unit: two browsers never run at once, each timing a page against the other's CPU.
BROWSER_FILES = {"test_startup.py", "test_ui_chat.py", "test_ui_flow.py", "test_ui_train.py", "test_slurm_e2e.py"}

# The units that take longest, longest first (seconds on the 2-core machine, measured with
# `--durations=0`, docs/testing.md): they start first, so the last units to start are short ones
# and neither worker ends long before the other. Units not named follow in file order.
LONGEST_FIRST = (
    "browser", "test_tensor_parallel.py", "test_preference.py", "test_pipeline_parallel.py", "test_expert_parallel.py",
    "test_cluster_e2e.py", "test_recovery.py", "test_failure_cause.py", "test_resume.py",
    "test_sequence_parallel.py", "test_collective_timeout.py", "test_chat_e2e.py", "test_checkpoint_safety.py",
    "test_run_owner.py", "test_long_sequence.py", "test_export.py", "test_worker_engines.py", "test_video.py",
)


def work_unit(nodeid: str) -> str:
    """The unit a worker takes whole under --dist loadgroup: the browser files together, else the file."""
    path = nodeid.split("::", 1)[0]
    return "browser" if Path(path).name in BROWSER_FILES else path


def unit_rank(nodeid: str) -> int:
    """Where a test's unit comes in LONGEST_FIRST (every unit not named after them)."""
    unit = work_unit(nodeid)
    name = unit if unit == "browser" else Path(unit).name
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def longest_first(items) -> None:
    """Sort the collected tests by unit_rank, in place (stable: a unit's tests keep their order).
    Every worker sorts its collection alike, which xdist requires."""
    items.sort(key=lambda item: unit_rank(item.nodeid))


def pytest_collection_modifyitems(items):
    """As a plugin (`-p xdist_units`); the suite's conftest calls longest_first in its own hook."""
    longest_first(items)


def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup, grouped by work_unit, the units in collection order (longest_first).
    xdist's own loadgroup carries the group in a suffix of the node id, which pytest 9.2's
    structured node ids drop without a word (pytest-xdist #1386): every test was then scheduled
    alone, a module's fixtures built on both workers and two browsers run at once. The scope is
    derived from the node id's file instead."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    # xdist would order the units by their number of tests; the collection's order is by time.
    config.option.loadscopereorder = False
    return ByWorkUnit(config, log)
