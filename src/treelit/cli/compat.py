"""``python -m treelit.cli.compat``: do the newest releases of treelit's fast-moving dependencies pass?

    python -m treelit.cli.compat                              # newest releases, bounds lifted
    python -m treelit.cli.compat --pin transformers==5.24.0   # one set, e.g. an older release
    python -m treelit.cli.compat --without kernels            # the same with a package removed
    python -m treelit.cli.compat --json compat.json           # also the result as JSON
    python -m treelit.cli.compat --pin torch==2.14.1          # another torch of the declared range
    python -m treelit.cli.compat --bounds                     # the declared ranges and tested releases only

``pyproject.toml`` bounds transformers, kernels, Lightning, MLflow and fla above at the newest
release the suite passed on (:data:`treelit.utils.versions.TESTED`), so a fresh install gets a
tested set. New releases land every few weeks; this check says whether they work before a bound
is raised. torch is declared as a range (:data:`treelit.utils.versions.TORCH_RANGE`); the check
installs the torch the suite runs on (``TESTED["torch"][0]``) unless ``--pin torch==X`` names another
release of the range. ``--bounds`` installs nothing: it prints each bounded package's range as
``pyproject.toml`` declares it, as :mod:`treelit.utils.versions` records it, and the releases
tested and not yet run, and exits 1 when the two disagree. It makes a fresh virtual environment, installs treelit from this checkout with its
other requirements as declared and the fast-moving ones unbounded (or as ``--pin`` says), runs the
transformers adapter and hybrid exactness tests there, and prints each package's bound, the
release installed and the outcome. The environment and the full pip / pytest log stay in
``--workdir`` (a temporary folder by default). Needs a source checkout (the tests are not
installed with the package) and the package index. Exit code 0 when the tests pass.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None

__all__ = ["main", "FAST_MOVING", "EXACTNESS_TESTS", "lifted_requirements"]

# the dependencies whose new releases have broken, or may break, the adapter (issue: transformers 5.25)
FAST_MOVING = ("transformers", "kernels", "flash-linear-attention", "lightning", "mlflow", "peft")
RANGED = ("torch",)  # declared as a range; the check installs the tested release unless --pin says
EXACTNESS_TESTS = (
    "tests/models/test_hf_kernel_names.py",
    "tests/models/test_hf_adapter.py",
    "tests/models/test_hf_hybrid.py",
    "tests/models/test_hf_hybrid_objectives.py",
    "tests/models/test_hf_hybrid_fla.py",
)
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(root: Path) -> List[str]:
    if tomllib is None:
        raise SystemExit("treelit.cli.compat needs Python >= 3.11 (tomllib)")
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    return list(project["dependencies"]) + list(project.get("optional-dependencies", {}).get("test", []))


def lifted_requirements(requirements: List[str], pins: Dict[str, str], without: List[str]) -> List[str]:
    """``requirements`` with each fast-moving package's version bound dropped (``pins`` gives its
    requirement instead), torch at the release the suite runs on (or its pin) and the packages
    in ``without`` left out."""
    from treelit.utils.versions import TESTED

    pins = {"torch": f"torch=={TESTED['torch'][0]}", **pins}
    out, seen = [], set()
    drop = {_norm(w) for w in without}
    for req in requirements:
        m = _NAME.match(req)
        name = _norm(m.group(1)) if m else ""
        if name in drop:
            continue
        if name in pins:
            out.append(pins[name])
            seen.add(name)
        elif name in FAST_MOVING:
            out.append(m.group(1) + (m.group(2) or ""))
        else:
            out.append(req)
    out += [p for n, p in pins.items() if n not in seen]
    return out


def _bounds(requirements: List[str], names=FAST_MOVING + RANGED) -> Dict[str, str]:
    out = {}
    for req in requirements:
        m = _NAME.match(req)
        if m and _norm(m.group(1)) in names:
            out[_norm(m.group(1))] = req[m.end():].split(";")[0].split("#")[0].strip() or "(none)"
    return out


def _run(cmd: List[str], log, cwd: Optional[Path] = None) -> int:
    log.write(f"\n$ {' '.join(cmd)}\n")
    log.flush()
    return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd).returncode


def _installed(python: Path) -> Dict[str, str]:
    code = ("import importlib.metadata as m, json, sys; n = sys.argv[1:]\n"
            "v = {}\nfor x in n:\n    try: v[x] = m.version(x)\n    except m.PackageNotFoundError: v[x] = None\n"
            "print(json.dumps(v))")
    res = subprocess.run([str(python), "-c", code, *FAST_MOVING, *RANGED], capture_output=True, text=True)
    return json.loads(res.stdout) if res.returncode == 0 else {}


def _tally(text: str) -> str:
    lines = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    return lines[-1].strip("= ") if lines else "no test summary (see the log)"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m treelit.cli.compat", description=__doc__.split("\n\n")[1])
    ap.add_argument("--pin", action="append", default=[], metavar="REQ",
                    help="a requirement for one fast-moving package instead of its newest release "
                         "(e.g. transformers==5.24.0); repeatable")
    ap.add_argument("--without", action="append", default=[], metavar="PKG",
                    help="uninstall PKG after installing (e.g. kernels: transformers' path without it)")
    ap.add_argument("--workdir", type=Path, default=None, help="where the environment and the log go")
    ap.add_argument("--tests", nargs="*", default=list(EXACTNESS_TESTS), help="pytest targets")
    ap.add_argument("--json", type=Path, default=None, help="also write the result here")
    ap.add_argument("--bounds", action="store_true",
                    help="print the declared ranges and the tested releases, install nothing")
    args = ap.parse_args(argv)

    import treelit

    root = Path(treelit.__file__).resolve().parents[2]
    if args.bounds and (root / "pyproject.toml").is_file():
        return print_bounds(_requirements(root))
    if not (root / "pyproject.toml").is_file() or not (root / "tests").is_dir():
        print(f"treelit.cli.compat: {root} is not a source checkout (pyproject.toml and tests/ are needed)",
              file=sys.stderr)
        return 2
    pins = {}
    for p in args.pin:
        m = _NAME.match(p)
        if not m or _norm(m.group(1)) not in FAST_MOVING + RANGED:
            print(f"--pin {p!r}: not one of the fast-moving packages {list(FAST_MOVING)} nor torch", file=sys.stderr)
            return 2
        pins[_norm(m.group(1))] = p
    work = args.workdir or Path(tempfile.mkdtemp(prefix="treelit-compat-"))
    work.mkdir(parents=True, exist_ok=True)
    venv, log_path = work / "venv", work / "compat.log"
    requirements = _requirements(root)
    wanted = lifted_requirements(requirements, pins, [])
    python = venv / "bin" / "python"
    t0 = time.time()
    with open(log_path, "w") as log:
        steps = [
            ("fresh virtual environment", [sys.executable, "-m", "venv", "--clear", str(venv)]),
            ("treelit from this checkout (no dependencies)",
             [str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(root)]),
            ("requirements, fast-moving ones unbounded", [str(python), "-m", "pip", "install", "-q", *wanted]),
        ]
        if args.without:
            steps.append((f"without {', '.join(args.without)}",
                          [str(python), "-m", "pip", "uninstall", "-q", "-y", *args.without]))
        for i, (what, cmd) in enumerate(steps, 1):
            print(f"[{i}/{len(steps) + 1}] {what} ...", flush=True)
            if _run(cmd, log) != 0:
                print(f"failed: {what} (log: {log_path})", file=sys.stderr)
                return 1
        print(f"[{len(steps) + 1}/{len(steps) + 1}] exactness tests: {' '.join(args.tests)} ...", flush=True)
        start = log.tell()
        rc = _run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *args.tests], log, cwd=root)
    tally = _tally(log_path.read_text()[start:])
    versions = _installed(python)
    bounds = _bounds(requirements)
    result = {"passed": rc == 0, "tests": tally, "versions": versions, "bounds": bounds,
              "pins": list(pins.values()), "without": args.without, "minutes": round((time.time() - t0) / 60, 1),
              "log": str(log_path)}
    print(f"\n{'package':<24}{'bound (pyproject)':<22}{'tried':<14}")
    for name in FAST_MOVING + RANGED:
        print(f"{name:<24}{bounds.get(name, '-'):<22}{versions.get(name) or 'absent':<14}")
    print(f"\n{'PASS' if rc == 0 else 'FAIL'}: {tally}  (torch {versions.get('torch')}, "
          f"{result['minutes']} min; log {log_path})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if rc == 0 else 1


def print_bounds(requirements: List[str]) -> int:
    """The ``--bounds`` table: each package of :data:`treelit.utils.versions.DECLARED`, its
    range in ``pyproject.toml`` and there, the releases tested and not yet run; 1 when a
    declared range and the recorded one disagree."""
    from treelit.utils.versions import DECLARED, NOT_RUN, TESTED

    declared = _bounds(requirements, tuple(DECLARED))
    bad = 0
    print(f"{'package':<16}{'pyproject.toml':<22}{'treelit.utils.versions':<24}{'tested':<18}not yet run")
    for name, spec in DECLARED.items():
        there = declared.get(name, "(absent)")
        same = there.replace(" ", "") == spec
        bad += not same
        print(f"{name:<16}{there:<22}{spec + ('' if same else '  DIFFERS'):<24}"
              f"{', '.join(TESTED.get(name, ())) or '-':<18}{', '.join(NOT_RUN.get(name, ())) or '-'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
