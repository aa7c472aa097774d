"""``treelit``: small utilities. ``treelit list`` shows every registered component and its origin."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="treelit", description="treelit utilities")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="list registered components (built-in and plugins)")
    st = sub.add_parser("stats", help="tree statistics of a data file")
    st.add_argument("path")
    st.add_argument("--builder", default="sequences")
    args = p.parse_args(argv)
    if args.cmd == "list":
        from treelit.registry import all_registries

        for kind, reg in all_registries().items():
            print(f"{kind}:")
            for e in reg.entries():
                print(f"  {e.name:<24} {e.source}")
        return 0
    if args.cmd == "stats":
        from treelit.builders.base import make_tree_builder
        from treelit.lightning.data import TreeDataModule

        dm = TreeDataModule(args.path, tree_builder=make_tree_builder(args.builder))
        for k, v in dm.stats().items():
            print(f"{k:>16}: {v}")
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
