"""Files that hold secrets are the owner's only, whatever the umask: the SQLite database with its
-wal/-shm (run specs carry env values), the run directory's job.yaml/plan.json written through
the first node, and the studio's data dir; a credential file open to others is warned about."""
from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import stat
import time

import pytest

from backend.cluster.launch import write_files
from backend.cluster.nodes import Pool
from backend.job.cluster import local_cluster
from backend.runs.manager import RunManager
from studio_server import start_studio


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def umask022():
    """The usual umask, under which files are 0644 unless created otherwise."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_the_database_and_its_companions_are_private(tmp_path, umask022):
    (tmp_path / "data").mkdir()
    for db in (tmp_path / "data" / "studio.db", tmp_path / "new-dir" / "studio.db"):
        manager = RunManager(f"sqlite:///{db}", reattach=False)
        try:
            manager.set_inventory(local_cluster())  # a write: WAL and shared memory in use
            assert {p.name: mode(p) for p in db.parent.iterdir()} == {
                "studio.db": 0o600, "studio.db-wal": 0o600, "studio.db-shm": 0o600}
        finally:
            manager.close()
    assert mode(tmp_path / "new-dir") == 0o700  # created for it


def test_an_older_open_database_is_tightened(tmp_path, umask022):
    (tmp_path / "data").mkdir()
    db = tmp_path / "data" / "studio.db"
    with sqlite3.connect(db) as conn:  # a database with content
        conn.execute("CREATE TABLE older (x)")
    db.chmod(0o644)
    RunManager(f"sqlite:///{db}", reattach=False).close()
    assert mode(db) == 0o600
    assert mode(db.parent) == 0o755  # an existing directory is left as it is


def test_the_default_data_dir_is_private(tmp_path, monkeypatch, umask022):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("SWIFT_STUDIO_DB", raising=False)
    RunManager(reattach=False).close()
    data = tmp_path / "xdg" / "swift-studio"
    assert mode(data) == 0o700 and mode(data / "studio.db") == 0o600


def test_run_directory_files_are_private(tmp_path, umask022):
    storage = tmp_path / "storage"  # made under the umask above, like an output directory
    storage.mkdir()
    existing = storage / "shared"
    existing.mkdir()
    (existing / "job.yaml.tmp").write_text("stale, 0644")
    files = {"job.yaml": "env:\n  HF_TOKEN: hf_secret\n", "plan.json": json.dumps({"env": {"HF_TOKEN": "hf_secret"}}),
             "ds_config.json": "{}", "sub/deep/x.json": "{}"}
    node = local_cluster().nodes[0]

    async def go(run_dir: str) -> None:
        pool = Pool()
        try:
            await write_files(pool, node, None, run_dir, files)
        finally:
            await pool.close()

    for run_dir in (storage / "out" / "run-1", existing):
        asyncio.run(go(str(run_dir)))
        for rel, text in files.items():
            assert (run_dir / rel).read_text() == text
            assert mode(run_dir / rel) == 0o600, rel
        assert mode(run_dir / "sub") == mode(run_dir / "sub" / "deep") == 0o700
    # Every directory the write created is the owner's; one that existed is left alone.
    assert mode(storage / "out") == mode(storage / "out" / "run-1") == 0o700
    assert mode(existing) == 0o755
    assert not list(existing.glob("*.tmp"))


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_a_studio_warns_of_a_readable_auth_file_and_keeps_its_files_private(tmp_path, umask022):
    auth = tmp_path / "auth"
    auth.write_text("alice:s3cret\n")
    auth.chmod(0o644)
    studio = start_studio(tmp_path, "--auth-file", str(auth))
    try:
        db = tmp_path / "studio.db"
        deadline = time.monotonic() + 60
        while not (db.exists() and os.path.exists(f"{db}-wal")) and time.monotonic() < deadline:
            time.sleep(0.2)  # the manager starts once the page answers
        log = studio.log.read_text()
        assert (f"warning: --auth-file {auth} is accessible to other users (mode 0644): anyone on this machine can "
                f"read the studio's passwords. Fix: chmod 600 {auth}") in log
        assert mode(db) == mode(f"{db}-wal") == mode(f"{db}-shm") == 0o600
        assert mode(tmp_path / "data" / "swift-studio") == 0o700
    finally:
        studio.stop()
