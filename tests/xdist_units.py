"""How scripts/test.sh's two xdist workers share the suite (a pytest plugin; conftest imports its hook)."""
from __future__ import annotations

from pathlib import Path

# scripts/test.sh runs two xdist workers (--dist loadgroup). These files start daemons (sshd,
# slurmctld/slurmd/munged), a studio and a browser, or wait out real timeouts, so their cores
# are mostly idle: they run in one worker, one after another, while the other files (training
# runs, mostly) are shared out a file at a time beside them, so a module's fixtures are built
# once. A browser or a Slurm controller never runs twice at once.
SERVICE_FILES = {
    "test_agent.py", "test_chat.py", "test_cluster_e2e.py", "test_collective_timeout.py", "test_failure_cause.py",
    "test_preflight.py", "test_recovery.py", "test_remote.py", "test_run_owner.py", "test_secret_files.py",
    "test_slurm_e2e.py", "test_startup.py", "test_telemetry_e2e.py", "test_ui_chat.py", "test_ui_flow.py",
    "test_ui_imports.py", "test_ui_train.py", "test_web_guard.py",
}


def work_unit(nodeid: str) -> str:
    """The unit a worker takes whole under --dist loadgroup: the service files together, else the file."""
    path = nodeid.split("::", 1)[0]
    return "services" if Path(path).name in SERVICE_FILES else path


def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup, grouped by work_unit. xdist's own loadgroup carries the group in a suffix
    of the node id, which pytest 9.2's structured node ids drop without a word (pytest-xdist
    #1386): every test was then scheduled alone, a module's fixtures built on both workers and
    two browsers run at once. The scope is derived from the node id's file instead."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByWorkUnit(config, log)
