"""The module graph runs one way: the import-linter contracts of ``pyproject.toml`` hold, the
graph (function-level imports included) has no cycle, function-level imports of treelit's own
modules appear only in the command-line layer, every module belongs to a layer, and package
faces import only their own children (lazily) and the bottom layer. See docs/design.md, "Layers".
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")


def _tool():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "benchmarks" / "import_graph.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("import_graph", mod)  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


g = _tool()
KNOWN, EDGES = g.graph()
LIVE = [e for e in EDGES if not e.guarded]  # TYPE_CHECKING imports never run


def _lint(config: Path, cwd: Path, extra_path: str = "") -> subprocess.CompletedProcess:
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.path.insert(0, {extra_path!r}) if {bool(extra_path)} else None; "
            f"raise SystemExit(lint_imports(config_filename={str(config)!r}, no_cache=True))")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)


def _layers():
    contracts = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c for c in contracts if c["type"] == "layers"]
    out = []
    for raw in layers["layers"]:
        out.append([m.strip() for m in raw.replace("|", ":").split(":")])
    return out


def test_import_contracts_hold():
    pytest.importorskip("importlinter")
    res = _lint(PYPROJECT, ROOT)
    assert res.returncode == 0, f"lint-imports: a contract of pyproject.toml is broken\n{res.stdout[-6000:]}{res.stderr[-2000:]}"


def test_a_back_edge_in_a_function_breaks_the_layers(tmp_path):
    """The contract is not vacuous: a lower layer importing a higher one inside a function fails."""
    pytest.importorskip("importlinter")
    pkg = tmp_path / "layered_demo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def f():\n    from layered_demo import high  # back-edge\n    return high\n")
    (pkg / "high.py").write_text("from layered_demo import low\n")
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(textwrap.dedent("""\
        [tool.importlinter]
        root_packages = ["layered_demo"]

        [[tool.importlinter.contracts]]
        name = "demo layers"
        type = "layers"
        layers = ["layered_demo.high", "layered_demo.low"]
        """))
    res = _lint(cfg, tmp_path, str(tmp_path))
    assert res.returncode == 1, res.stdout
    assert "layered_demo.low -> layered_demo.high" in res.stdout


def test_no_cycles_function_level_imports_included():
    assert g.cycles(list(KNOWN), LIVE) == []


def test_cycle_finder_finds_a_cycle():
    e = g.Edge
    edges = [e("a", "b", 1, False, False), e("b", "c", 1, True, False), e("c", "a", 1, False, False), e("c", "d", 1, False, False)]
    assert g.cycles(["a", "b", "c", "d"], edges) == [["a", "b", "c"]]


def test_function_level_imports_of_treelit_only_in_the_commands():
    """A module imports the modules it uses at its top; only the command-line layer (each command
    pays for what it runs) imports treelit's modules inside functions. A module kept light
    reaches a heavy one through a package face (``treelit.lazy``)."""
    local = [f"{e.src}:{e.line} -> {e.dst}" for e in LIVE if e.local and not e.src.startswith("treelit.cli.")]
    assert local == [], "function-level imports of treelit modules outside treelit.cli:\n" + "\n".join(local)


def _layer_index():
    index = {}
    for i, layer in enumerate(_layers()):
        for name in layer:
            index[name] = i
    return index


def _layer_of(module, index):
    parts = module.split(".")
    while parts:
        name = ".".join(parts)
        if name in index:
            return name
        parts.pop()
    return None


def _is_face(module):
    return KNOWN[module].name == "__init__.py"


def test_every_module_belongs_to_a_layer():
    index = _layer_index()
    missing = [m for m in KNOWN if _layer_of(m, index) is None and not _is_face(m)]
    assert missing == [], ("modules in no layer of [tool.importlinter] in pyproject.toml (place each where "
                           f"its imports put it): {missing}")


def test_package_faces_import_only_their_children_and_the_bottom():
    """A package ``__init__`` that re-exports its children ties every layer they touch into one circle
    when a sibling imports any one of its submodules; faces import their own children (or reach them
    lazily, treelit.lazy) and the bottom layer only."""
    bad = [f"{e.src}:{e.line} -> {e.dst}" for e in LIVE if _is_face(e.src)
           and not (e.dst.startswith(e.src + ".") or e.dst in ("treelit.lazy", "treelit.registry"))]
    assert bad == [], "package faces importing outside their package:\n" + "\n".join(bad)


def test_the_registry_and_lazy_modules_import_nothing_of_treelit():
    bad = [f"{e.src} -> {e.dst}" for e in EDGES if e.src in ("treelit.registry", "treelit.lazy")]
    assert bad == []


# Function-level imports of packages outside treelit: only what is optional, platform-bound or heavy
# enough (>= ~0.3 s CPU, measured with python -X importtime) that a module's importers should not all
# pay for it, each with a one-line reason on the import line. Everything else (the standard library,
# torch, numpy, tqdm, safetensors, yaml, ...) is imported at the top of the module.
DEFERRABLE = {
    "transformers": "optional (hf extra) and ~1.5 s CPU: Hugging Face paths only",
    "huggingface_hub": "comes with transformers; the same paths",
    "datasets": "optional, ~2 s CPU: data=hf_dataset only",
    "pyarrow": "~0.3 s CPU: Parquet files only",
    "fla": "optional (treelit[cuda]), Triton kernels: ssm=fla only",
    "mamba_ssm": "optional (treelit[cuda]), a CUDA build",
    "triton": "optional, GPU kernels",
    "mlflow": "~1 s CPU: with the MLflow logger only",
    "sqlalchemy": "MLflow's database layer: only when a local MLflow store is built",
    "alembic": "MLflow's schema migrations: only when a local MLflow store is checked or built",
    "lightning": "~5 s CPU: below the Lightning layer only where a run is built",
    "torchtune": "loads torchao and datasets (~5 s CPU): only where a decoder is built",
    "torchao": "heavy, reached through torchtune",
    "matplotlib": "~1 s CPU: only when a plot is drawn",
    "torch.distributed.fsdp": "~0.9 s CPU on top of torch: only when a model is sharded",
    "torch.distributed.checkpoint": "~1 s CPU on top of torch: sharded checkpoints only",
    "peft": "~3 s CPU (it imports transformers): LoRA runs only",
    "fcntl": "POSIX only: the module stays importable where it is missing",
}
# The command-line layer defers more: each command pays only for what it runs (``treelit --help``
# and ``treelit stats`` pay no Hydra, ``treelit-train --help`` no torch), and it is also the one
# layer that imports treelit's own modules inside functions (test above).
CLI_DEFERRABLE = {"torch": "treelit-train --help and treelit-rollout --help pay no torch",
                  "hydra": "treelit stats and treelit --help pay no Hydra",
                  "omegaconf": "as Hydra"}


def _covered(name, allowed):
    return any(name == a or name.startswith(a + ".") for a in allowed)


def _reason(comment):
    import re

    return re.sub(r"noqa(:\s*[A-Z]+\d+(,\s*[A-Z]+\d+)*)?", "", comment).strip(" ()")


def _local_import_faults(src, package):
    faults = []
    for mod, line, names, comment in g.local_import_statements(src, package):
        allowed = set(DEFERRABLE) | (set(CLI_DEFERRABLE) if mod.startswith(package + ".cli.") else set())
        for name in names:
            if not _covered(name, allowed):
                faults.append(f"{mod}:{line} imports {name} inside a function (move it to the top of the module)")
        if not _reason(comment):
            faults.append(f"{mod}:{line} imports {', '.join(names)} inside a function without a '# reason' comment")
    return faults


def test_function_level_third_party_imports_are_deferrable_and_say_why():
    faults = _local_import_faults(g.SRC, g.PACKAGE)
    assert faults == [], "\n".join(faults)


def test_the_local_import_rule_can_fail(tmp_path):
    pkg = tmp_path / "demo"
    (pkg / "cli").mkdir(parents=True)
    for f in ("__init__.py", "cli/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "low.py").write_text(textwrap.dedent("""\
        def a():
            import os
        def b():
            import transformers
        def c():
            from torch.distributed.fsdp import fully_shard  # heavy: sharding only
        def d():
            import torch  # noqa: F401
        def e():
            from datasets import (  # optional: hf_dataset only
                load_dataset,
            )
        """))
    (pkg / "cli" / "cmd.py").write_text("def f():\n    import torch  # --help pays no torch\n    from demo import low\n")
    faults = _local_import_faults(tmp_path, "demo")
    assert faults == [
        "demo.low:2 imports os inside a function (move it to the top of the module)",
        "demo.low:2 imports os inside a function without a '# reason' comment",
        "demo.low:4 imports transformers inside a function without a '# reason' comment",
        "demo.low:8 imports torch inside a function (move it to the top of the module)",
        "demo.low:8 imports torch inside a function without a '# reason' comment",
    ]
