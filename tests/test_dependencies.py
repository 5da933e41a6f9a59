"""The engines installed are the ones pyproject.toml pins: the model-parallel tests prove those."""
from __future__ import annotations

import re
from importlib.metadata import version

import pytest
from packaging.specifiers import SpecifierSet

from worker import ROOT

PINNED = ("torch", "transformers", "peft", "deepspeed")


def test_the_installed_engines_are_the_pinned_ones():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    requirements = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {}
    for line in requirements:
        name, spec = re.match(r"([A-Za-z0-9_.-]+)(.*)", line).groups()
        pins[name.lower()] = SpecifierSet(spec)
    for name in PINNED:
        installed = version(name).split("+")[0]  # torch's local tag (+cpu, +cu130)
        assert installed in pins[name], f"{name} {installed} is not {pins[name]} (pyproject.toml)"
