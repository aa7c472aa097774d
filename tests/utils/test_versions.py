"""The dependency ranges ``pyproject.toml`` declares agree with :mod:`treelit.utils.versions`
(and with ``python -m treelit.cli.compat --bounds``); every release recorded as tested lies in
its range, and every end of a range is either tested or listed as not yet run (so an untested
end is never presented as tested). The README's install and test commands, and CI's, take the
torch the suite runs on through ``constraints.txt``: with torch a range, a plain install on a
fresh machine resolves to the newest torch of it, a CUDA build of several GB."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from treelit.cli import compat
from treelit.utils.versions import DECLARED, NOT_RUN, TESTED, TORCH_RANGE

REPO = Path(__file__).resolve().parents[2]
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


def _declared() -> dict:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {canonicalize_name(r.name): r.specifier for r in map(Requirement, deps)}


def test_pyproject_declares_what_treelit_utils_versions_records():
    declared = _declared()
    for name, spec in DECLARED.items():
        assert name in declared, f"{name} is not a dependency in pyproject.toml"
        assert declared[name] == SpecifierSet(spec), f"{name}: pyproject.toml {declared[name]}, versions {spec}"
    assert DECLARED["torch"] == f">={TORCH_RANGE[0]},<={TORCH_RANGE[1]}"


def test_torch_is_a_range_whose_lower_end_is_the_tested_release():
    spec = SpecifierSet(DECLARED["torch"])
    assert not any(s.operator == "==" for s in spec), "torch is an exact pin again"
    assert TORCH_RANGE[0] != TORCH_RANGE[1] and TORCH_RANGE[0] in spec and TORCH_RANGE[1] in spec
    assert TESTED["torch"][0] == TORCH_RANGE[0]


def test_tested_releases_lie_in_their_range_and_every_end_is_tested_or_said_not_run():
    for name, releases in TESTED.items():
        if name in DECLARED:
            for r in releases:
                assert r in SpecifierSet(DECLARED[name]), f"{name} {r} is outside {DECLARED[name]}"
    for name, spec in DECLARED.items():
        for s in SpecifierSet(spec):
            if s.operator in ("<=", "==") and name in TESTED:
                end = s.version
                assert end in TESTED[name] or end in NOT_RUN.get(name, ()), f"{name} {s}: neither tested nor NOT_RUN"
    for name, ends in NOT_RUN.items():
        assert not set(ends) & set(TESTED.get(name, ())), f"{name}: listed as tested and as not run"


def test_compat_bounds_prints_every_range_and_agrees(capsys):
    assert compat.main(["--bounds"]) == 0
    out = capsys.readouterr().out
    for name, spec in DECLARED.items():
        line = next(ln for ln in out.splitlines() if ln.startswith(name + " "))
        assert line.split()[1] == spec and line.split()[2] == spec and "DIFFERS" not in line, line
    torch = next(ln for ln in out.splitlines() if ln.startswith("torch "))
    assert torch.split()[3:] == [TESTED["torch"][0], TORCH_RANGE[1]], torch


def test_compat_installs_the_tested_torch_unless_pinned():
    reqs = [f"torch{DECLARED['torch']}", "transformers>=5.24,<=5.25.0", "numpy>=1.26"]
    assert compat.lifted_requirements(reqs, {}, []) == [f"torch=={TESTED['torch'][0]}", "transformers", "numpy>=1.26"]
    assert compat.lifted_requirements(reqs, {"torch": "torch==2.14.1"}, [])[0] == "torch==2.14.1"


def test_the_readme_and_ci_install_the_tested_torch_through_constraints():
    pins = [ln.strip() for ln in (REPO / "constraints.txt").read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]
    assert pins == [f"torch=={TESTED['torch'][0]}"], pins
    readme = (REPO / "README.md").read_text()
    install = "pip install -e . -c constraints.txt"
    tests = 'pip install -q -e ".[test]" -c constraints.txt && python -m pytest -q'
    assert install in readme and tests in readme
    assert re.search(r"^python3 -m venv \.venv && \. \.venv/bin/activate && " + re.escape(tests) + "$",
                     (REPO / ".ci" / "run").read_text(), re.M), "CI does not run the README's test command"
