"""Shared fixtures."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
for p in (str(ROOT), str(ROOT / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)


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


# tryfirst: xdist's own hook in each worker turns the mark into the id it schedules by, and it
# runs before a conftest's hook otherwise.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group("services" if item.path.name in SERVICE_FILES else item.path.stem))


@pytest.fixture(scope="session")
def sshd_nodes(tmp_path_factory):
    """Two real OpenSSH servers on 127.0.0.2 and 127.0.0.3 with key auth and a known_hosts file."""
    from sshd import start_cluster

    cluster = start_cluster(tmp_path_factory.mktemp("sshd"), 2)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A 2-layer, 64-wide Qwen2 model with the demo tokenizer, on disk (for the worker tests)."""
    from worker import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_families(tmp_path_factory):
    """Tiny Llama, Mistral and Qwen3 models of tiny_model's sizes (grouped-query attention, untied)."""
    from worker import build_tiny_model

    return {family: build_tiny_model(tmp_path_factory.mktemp(family), family) for family in ("llama", "mistral", "qwen3")}

