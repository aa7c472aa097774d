"""The package's import graph, function-level imports included, read from the source with ``ast``.

    python benchmarks/import_graph.py                 # cycles, back-edges, local imports
    python benchmarks/import_graph.py --edges         # every intra-package edge (module -> module, line, local?)
    python benchmarks/import_graph.py --local         # the summary, then each function-level third-party import and its reason

``lint-imports`` checks the contracts in ``pyproject.toml`` (grimp reads function bodies
too). This script answers what the contracts do not: whether the graph has a cycle,
which imports of treelit's own modules sit inside functions (allowed only in
``treelit.cli``) and which third-party packages are imported inside functions.
``tests/test_import_graph.py`` uses it.

An edge ``a -> b`` means module ``a`` imports ``b`` (``from treelit.p import n`` counts as an
edge to ``treelit.p.n`` when that is a module, else to ``treelit.p``). Package ``__init__``
modules are nodes of their own (``treelit.tree`` is ``src/treelit/tree/__init__.py``);
importing ``treelit.tree.batch`` also runs ``treelit.tree``, but that is not counted as an
edge: what a module depends on is what it names.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "treelit"


@dataclass(frozen=True)
class Edge:
    src: str  # importing module
    dst: str  # imported module
    line: int
    local: bool  # inside a function body (not run at import time)
    guarded: bool  # under ``if TYPE_CHECKING:`` (never run)


def modules(src: Path = SRC, package: str = PACKAGE) -> Dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the package."""
    out: Dict[str, Path] = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(name: str, known: Dict[str, Path]) -> Optional[str]:
    """The deepest known module that ``name`` is or lies in (``treelit.tree.batch.TreeBatch`` ->
    ``treelit.tree.batch``), or None outside the package."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in known:
            return cand
        parts.pop()
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, local: bool, guarded: bool) -> Iterator[Tuple[ast.AST, bool, bool]]:
    for child in ast.iter_child_nodes(node):
        child_local = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        child_guarded = guarded or (isinstance(child, ast.If) and _is_type_checking(child.test))
        yield child, child_local, child_guarded
        yield from _walk(child, child_local, child_guarded)


def imports(module: str, path: Path) -> Iterator[Tuple[str, int, bool, bool, str]]:
    """(imported name, line, local, guarded, kind) for every import statement of ``module``;
    ``kind`` is "import" or "from". Relative imports are resolved against ``module``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    for node, local, guarded in _walk(tree, False, False):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, local, guarded, "import"
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_pkg else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                yield (f"{base}.{alias.name}" if alias.name != "*" else base), node.lineno, local, guarded, "from"


def graph(src: Path = SRC, package: str = PACKAGE) -> Tuple[Dict[str, Path], List[Edge]]:
    known = modules(src, package)
    edges: List[Edge] = []
    for mod, path in known.items():
        for name, line, local, guarded, _ in imports(mod, path):
            dst = _resolve(name, known)
            if dst is None or dst == mod:
                continue
            edges.append(Edge(mod, dst, line, local, guarded))
    return known, edges


def third_party_local_imports(src: Path = SRC, package: str = PACKAGE) -> List[Tuple[str, int, str]]:
    """(module, line, imported name) of every function-level import of something outside the package."""
    known = modules(src, package)
    out = []
    for mod, path in known.items():
        for name, line, local, guarded, _ in imports(mod, path):
            if local and not guarded and not name.startswith(package + ".") and name != package:
                out.append((mod, line, name))
    return out


def local_import_statements(src: Path = SRC, package: str = PACKAGE) -> List[Tuple[str, int, List[str], str]]:
    """(module, line, imported names, comment) of every function-level import statement of
    something outside the package (``TYPE_CHECKING`` blocks left out); ``comment`` is the text
    after ``#`` on the statement's lines ("" when there is none): the reason it is not at the top."""
    out = []
    for mod, path in modules(src, package).items():
        text = path.read_text()
        lines = text.splitlines()
        for node, local, guarded in _walk(ast.parse(text, filename=str(path)), False, False):
            if not local or guarded or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if not node.level else []
            else:
                names = [a.name for a in node.names]
            names = [n for n in names if n != package and not n.startswith(package + ".")]
            if not names:
                continue
            span = lines[node.lineno - 1: (node.end_lineno or node.lineno)]
            comment = " ".join(ln.split("#", 1)[1].strip() for ln in span if "#" in ln)
            out.append((mod, node.lineno, names, comment))
    return out


def cycles(nodes: List[str], edges: List[Edge]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    adj: Dict[str, Set[str]] = {n: set() for n in nodes}
    for e in edges:
        adj[e.src].add(e.dst)
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []
    counter = [0]

    def strong(v: str) -> None:  # recursion depth is bounded by the module count (~100)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(adj[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for n in sorted(nodes):
        if n not in index:
            strong(n)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    known, edges = graph()
    live = [e for e in edges if not e.guarded]
    if "--edges" in argv:
        for e in sorted(live, key=lambda e: (e.src, e.dst, e.line)):
            print(f"{e.src} -> {e.dst}  (line {e.line}{', local' if e.local else ''})")
        return 0
    local = [e for e in live if e.local]
    print(f"{len(known)} modules, {len(live)} intra-package edges ({len(local)} function-level)")
    comps = cycles(list(known), live)
    print(f"{len(comps)} cycle(s)" + (":" if comps else ""))
    for c in comps:
        print(f"  {len(c)} modules: {', '.join(c)}")
    top = cycles(list(known), [e for e in live if not e.local])
    print(f"{len(top)} cycle(s) among module-level imports alone")
    for e in sorted(local, key=lambda e: (e.src, e.line)):
        print(f"  local: {e.src}:{e.line} -> {e.dst}")
    tp = third_party_local_imports()
    print(f"{len(tp)} function-level imports of third-party modules")
    if "--local" in argv:  # each with its reason (the comment on the import line)
        for mod, line, names, comment in local_import_statements():
            print(f"  {mod}:{line} {', '.join(names)}  # {comment or '(no reason given)'}")
    return 1 if comps else 0


if __name__ == "__main__":
    sys.exit(main())
