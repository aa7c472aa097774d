"""``python -m treelit.cli.config_reference``: the configuration reference, generated from the configs.

    python -m treelit.cli.config_reference --write docs/config-reference.md   # regenerate the page
    python -m treelit.cli.config_reference --check docs/config-reference.md   # exit 1 if stale / undocumented

The YAML comment is the single source of an option's description: the comment at the end of the
option's line, or the comment lines directly above it. Every config group under ``treelit/conf``
becomes a section listing each of its options (a dotted path for nested ones), the config files
(group options) that set it with their defaults, its type, and its description. An option set in
several files of a group needs its comment in one of them (the group's default file is the usual
place). Hydra's logging config and the experiment presets (which set other groups' options) are
listed by their header comment only. ``tests/test_docs.py`` fails when an option has no
description or when the page differs from what this module generates.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import yaml

__all__ = ["reference", "undocumented", "main"]

CONF = Path(__file__).resolve().parents[1] / "conf"
_KEY = re.compile(r"^(\s*)([A-Za-z_][\w.]*)\s*:(.*)$")
_SKIP = {"_target_", "_partial_", "defaults"}
PRESET_GROUPS = ("experiment",)  # files that set other groups' options: listed by their header comment


@dataclass
class Option:
    path: str
    description: str = ""
    values: Dict[str, str] = field(default_factory=dict)  # config file -> default
    types: set = field(default_factory=set)


def _comment(text: str) -> str:
    return text.strip().lstrip("#").strip()


def _trailing_comment(rest: str) -> str:
    """The comment after a value on the same line (a '#' outside quotes)."""
    quote = None
    for i, ch in enumerate(rest):
        if ch in "'\"":
            quote = None if quote == ch else (quote or ch)
        elif ch == "#" and quote is None and (i == 0 or rest[i - 1].isspace()):
            return _comment(rest[i:])
    return ""


def _header(lines: List[str]) -> str:
    out = []
    for ln in lines:
        if not ln.startswith("#"):
            break
        out.append(_comment(ln))
    return " ".join(x for x in out if x)


def _type_name(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "required" if value == "???" else ("interpolation" if value.startswith("${") else "str")
    if isinstance(value, list):
        return "list"
    return "mapping"


def _leaves(path: Path) -> List[Tuple[str, str, object]]:
    """(dotted key, description, value) of each leaf option of one YAML file, in file order."""
    text = path.read_text()
    data = yaml.safe_load(text) or {}
    lines = text.split("\n")
    out, stack = [], []
    for i, ln in enumerate(lines):
        m = _KEY.match(ln)
        if not m:
            continue
        indent, key, rest = len(m.group(1)), m.group(2), m.group(3)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parts = [s[1] for s in stack] + [key]
        stack.append((indent, key))
        if key in _SKIP or parts[0] in _SKIP or parts[0] == "hydra":
            continue
        value = data
        for p in parts:
            value = value.get(p) if isinstance(value, dict) else None
        if isinstance(value, dict) and value:
            continue  # a section: its leaves are the options
        desc = _trailing_comment(rest)
        j, above = i - 1, []
        while j >= 0 and lines[j].strip().startswith("#") and len(lines[j]) - len(lines[j].lstrip()) == indent:
            above.insert(0, _comment(lines[j]))
            j -= 1
        if not desc and above and j >= 0:  # (a block that starts the file is its header, not this option's)
            desc = " ".join(above)
        out.append((".".join(parts), desc, value))
    return out


def _groups() -> Dict[str, List[Path]]:
    out: Dict[str, List[Path]] = {"(root: train.yaml)": [CONF / "train.yaml"]}
    for d in sorted(p for p in CONF.iterdir() if p.is_dir() and p.name != "hydra"):
        out[d.name] = sorted(d.glob("*.yaml"))
    return out


def _collect(files: List[Path]) -> Dict[str, Option]:
    opts: Dict[str, Option] = {}
    for f in files:
        for key, desc, value in _leaves(f):
            o = opts.setdefault(key, Option(key))
            o.description = o.description or desc
            o.values[f.stem] = _show(value)
            o.types.add(_type_name(value))
    return opts


def _show(value) -> str:
    if isinstance(value, str):
        return value
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def _command_flags() -> List[Tuple[str, str, str, str]]:
    """``treelit-rollout``'s flags: (flag, type, default, help), from its own parser."""
    from treelit.cli.rollout import parser  # (its flags' help is their single source, as a YAML comment is)

    out = []
    for action in parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        if action.choices:
            kind = "choice"
        elif action.nargs == 0:  # store_true / store_false: a switch
            kind = "bool"
        else:
            kind = getattr(action.type, "__name__", None) or "str"
        default = "required" if action.required else _show(action.default)
        text = action.help or ""
        if action.choices:
            text = " | ".join(action.choices) + (f": {text}" if text else "")
        out.append((action.option_strings[0], kind, default, text))
    return out


def undocumented() -> List[str]:
    """``group: option`` for each option with no description."""
    out = [f"treelit-rollout: {flag}" for flag, _, _, text in _command_flags() if not text]
    for group, files in _groups().items():
        if group in PRESET_GROUPS:
            continue
        out += [f"{group}: {k}" for k, o in _collect(files).items() if not o.description]
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def reference() -> str:
    """The Markdown page."""
    out = ["# Configuration reference", "",
           "Generated by `python -m treelit.cli.config_reference --write docs/config-reference.md` from the "
           "config files shipped in `treelit/conf/` (each description is the option's YAML comment); "
           "`tests/test_docs.py` fails when it is stale. Select a group's option with `GROUP=OPTION` and set a "
           "value with `GROUP.KEY=VALUE` (e.g. `treelit-train data=jsonl data.train_path=trees.jsonl`); "
           "`treelit list` shows the options plugins add.", ""]
    for group, files in _groups().items():
        out += [f"## {group}", ""]
        if group in PRESET_GROUPS:
            out += ["| option | what it sets |", "|---|---|"]
            out += [f"| `{f.stem}` | {_cell(_header(f.read_text().split(chr(10))))} |" for f in files]
            out.append("")
            continue
        if group != "(root: train.yaml)":
            heads = [f"`{f.stem}`: {_header(f.read_text().split(chr(10))).rstrip('.')}".rstrip(": ") for f in files]
            out += ["Options: " + "; ".join(heads) + ".", ""]
        out += ["| key | type | default (per option) | description |", "|---|---|---|---|"]
        for key, o in _collect(files).items():
            vals = sorted(set(o.values.values()))
            if len(vals) == 1 and len(files) > 1 and len(o.values) == len(files):
                default = f"`{vals[0]}`"
            elif len(files) == 1:
                default = f"`{vals[0]}`"
            else:
                default = ", ".join(f"{f}: `{v}`" for f, v in o.values.items())
            types = "/".join(sorted(o.types))
            out.append(f"| `{key}` | {types} | {_cell(default)} | {_cell(o.description)} |")
        out.append("")
    out += ["## treelit-rollout", "",
            "The reference sampler worker of the online RL loop (`treelit-rollout --help`); its flags, from its parser.",
            "", "| flag | type | default | description |", "|---|---|---|---|"]
    out += [f"| `{flag}` | {kind} | `{default}` | {_cell(text)} |" for flag, kind, default, text in _command_flags()]
    return "\n".join(out).rstrip() + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m treelit.cli.config_reference")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", type=Path, help="write the page here")
    mode.add_argument("--check", type=Path, help="exit 1 if this page is stale or an option is undocumented")
    args = ap.parse_args(argv)
    missing = undocumented()
    page = reference()
    if args.check:
        stale = not args.check.is_file() or args.check.read_text() != page
        for m in missing:
            print(f"no description (add a YAML comment): {m}", file=sys.stderr)
        if stale:
            print(f"{args.check} is stale: python -m treelit.cli.config_reference --write {args.check}", file=sys.stderr)
        return 1 if stale or missing else 0
    if args.write:
        args.write.write_text(page)
    else:
        sys.stdout.write(page)
    for m in missing:
        print(f"no description (add a YAML comment): {m}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
