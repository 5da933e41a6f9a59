"""The suite's own layout: scripts/test.sh's two xdist workers rely on conftest's groups."""
import os
from pathlib import Path

import pytest

from conftest import SERVICE_FILES


def test_every_service_file_exists():
    here = Path(__file__).parent
    assert sorted(name for name in SERVICE_FILES if not (here / name).is_file()) == []


def test_a_test_runs_in_its_files_group_under_xdist(request):
    if "PYTEST_XDIST_WORKER" not in os.environ:
        pytest.skip("plain pytest has no groups (scripts/test.sh runs xdist)")
    assert request.node.nodeid.endswith("@test_suite"), request.node.nodeid
