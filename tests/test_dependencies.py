"""The packages installed are the ones pyproject.toml bounds: the engines the model-parallel tests
prove, and the test packages the suite is known to pass with."""
from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version

import pytest
from packaging.specifiers import SpecifierSet

from worker import ROOT

PINNED = ("torch", "transformers", "peft", "deepspeed")


def requirements(*where: str) -> dict[str, SpecifierSet]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for key in where:
        table = table[key]
    return {name.lower(): SpecifierSet(spec)
            for name, spec in (re.match(r"([A-Za-z0-9_.-]+)(.*)", line).groups() for line in table)}


def outside(bounds: dict[str, SpecifierSet], names) -> list[str]:
    found = []
    for name in names:
        try:
            installed = version(name).split("+")[0]  # torch's local tag (+cpu, +cu130)
        except PackageNotFoundError:
            found.append(f"{name} is not installed (pyproject.toml: {bounds[name]})")
            continue
        if installed not in bounds[name]:
            found.append(f"{name} {installed} is not {bounds[name]} (pyproject.toml)")
    return found


def test_the_installed_engines_are_the_pinned_ones():
    assert outside(requirements("dependencies"), PINNED) == []


def test_the_installed_test_packages_are_within_the_test_extras_bounds():
    """A fresh install takes the newest release the extra admits; one the suite was never run
    with (pytest 9.2 changed approx and node ids) must not pass unnoticed."""
    bounds = requirements("optional-dependencies", "test")
    assert all(any(s.operator == "<" for s in spec) and any(s.operator == ">=" for s in spec)
               for spec in bounds.values()), bounds
    assert outside(bounds, bounds) == []
