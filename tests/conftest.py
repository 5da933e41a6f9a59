"""Shared fixtures."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
for p in (str(ROOT), str(ROOT / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)


from backend.cluster.remote import HOST_ID_ENV  # noqa: E402

# Each pytest process counts as a host of its own when admission counts the ranks running on a
# node: the two xdist workers (and a second suite on this machine) train on the same cores at once
# without refusing each other's runs. The test sshd servers name their own (tests/sshd.py).
os.environ[HOST_ID_ENV] = f"pytest-{os.getpid()}"

from xdist_units import longest_first, pytest_xdist_make_scheduler  # noqa: F401 (a hook: how the two xdist workers share the suite)


def pytest_addoption(parser):
    parser.addoption("--reverse-order", action="store_true",
                     help="run the tests in reverse order (no test may depend on another having run first)")


def pytest_collection_modifyitems(config, items):
    longest_first(items)
    if config.getoption("reverse_order"):
        items.reverse()


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

