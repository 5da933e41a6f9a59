"""The studio process stays small: building the whole page (every tab, the manager, a check of
the demo job) imports none of the worker's libraries."""
from __future__ import annotations

import json
import subprocess
import sys

from studio_server import REPO

PROBE = r"""
import json, sys
from pathlib import Path
from concurrent.futures import Future
from backend.job.cluster import local_cluster
from backend.job.demo import demo_spec
from backend.runs.manager import RunManager
from studio.app import build_app
from studio.context import Studio
from studio.form import spec_to_form, default_form
from studio.train_view import check_form

studio = Studio(Path(sys.argv[1]), Path(sys.argv[1]) / "runs")
studio.manager_future.set_result(RunManager("sqlite://", reattach=False))
build_app(studio)
view = check_form(default_form() | spec_to_form(demo_spec().model_dump()), local_cluster())
assert view.spec is not None and "torch.distributed.run" in view.commands, view.other_problems
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "deepspeed", "peft"))
print(json.dumps(heavy))
"""


def test_studio_never_imports_the_worker_stack(tmp_path):
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


# The page answers before the manager exists (studio/server.py starts it afterwards, on its own
# thread): building it must not wait for the database and SSH libraries.
PAGE_ONLY_PROBE = r"""
import json, sys
from pathlib import Path
from studio.app import build_app
from studio.context import Studio

build_app(Studio(Path(sys.argv[1]), Path(sys.argv[1]) / "runs"))
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & {"sqlalchemy", "sqlmodel", "asyncssh"})))
"""


def test_the_page_builds_without_the_database_and_ssh_libraries(tmp_path):
    out = subprocess.run([sys.executable, "-c", PAGE_ONLY_PROBE, str(tmp_path)], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_refuses_a_public_address_without_authentication(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "XDG_DATA_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "backend.cli", "studio", "--host", "0.0.0.0", "--port", "1"],
                         cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2
    assert "refusing to serve on 0.0.0.0 without authentication" in out.stderr
    assert "SWIFT_STUDIO_AUTH=user:password" in out.stderr and "--auth-file" in out.stderr
    assert "Traceback" not in out.stderr
