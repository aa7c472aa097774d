"""``treelit``: small utilities.

    treelit list                          # every component, and the config option that selects it
    treelit stats DATA                    # flat/tree tokens, POR, ideal speedup of a data file
    treelit stats 'shards/*.jsonl.gz' more/   # files, globs, directories: as data=stream reads them
    treelit stats tau_bench_airline/gpt-4o-airline.json.gz --group-key task_id   # a bundled file, chat data
    treelit stats agent.jsonl --processor CKPT   # records with images (a vision checkpoint's processor)

``treelit list`` prints names as they are used in ``treelit-train`` options: a kind that
is a config group (``model``, ``attention``, ...) lists its config options, each
registered component with its origin and the presets that only exist as config files;
a name that cannot be selected as ``group=NAME`` (a plugin without a config file) is
shown with the override that selects it; a data source with the ``data=`` option that
streams it; then the config groups that are not registry kinds (``data``, ``optimizer``,
``trainer``, ...) with their options, as the README's table lists them. ``treelit stats`` reads token records and
chat records alike (the builder is detected from the first record; chat data is
tokenized with ``--tokenizer``, by default the bundled Qwen2 BPE; records with images need
``--processor DIR``, a vision checkpoint's folder). Images and recorded MoE routing are
counted too. Errors in the input print one line, no traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List, Optional

from treelit.cli.args import OneLineParser

__all__ = ["main", "config_options", "SELECT"]

# how each registry kind is selected in treelit-train's config ("" = a config group of that name)
SELECT: Dict[str, str] = {
    "model": "",
    "tree_builder": "",
    "attention": "",
    "ssm": "",
    "partition": "",
    "objective": "",
    "advantage": "tree_builder.advantage",
}
# kinds chosen on another command's line, not in the training config
COMMANDS: Dict[str, str] = {"reward": "treelit-rollout --reward NAME"}
# the key naming the component inside a group's config files
NAME_KEY = {"model": "preset"}
# data sources are chosen through the data option that streams them (its data.source.name)
SOURCE_GROUP, SOURCE_KEY = "data", "source.name"


def config_options(group: str) -> List[str]:
    """The options of config group ``group`` (treelit's and plugins' config files)."""
    return _group_options([group])[group]


def _group_options(groups: Optional[List[str]] = None) -> Dict[str, List[str]]:
    """The options of each config group (every group but Hydra's when ``groups`` is None)."""
    from hydra import initialize_config_dir  # cli: only treelit list reads the config groups
    from hydra.core.global_hydra import GlobalHydra  # as above

    from treelit.cli.config import CONF_DIR, register_resolvers

    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        names = groups if groups is not None else [g for g in loader.list_groups("") if g != "hydra"]
        return {g: sorted(loader.get_group_options(g)) for g in names}


def _source_options(data_options: List[str]) -> Dict[str, List[str]]:
    """For each data source name, the ``data=`` options that stream from it (read from their
    config files' ``source.name``)."""
    from omegaconf import OmegaConf  # cli: only treelit list reads the config files

    from treelit.cli.config import CONF_DIR

    found: Dict[str, List[str]] = {}
    for opt in data_options:
        f = Path(CONF_DIR) / SOURCE_GROUP / f"{opt}.yaml"
        name = OmegaConf.select(OmegaConf.load(f), SOURCE_KEY) if f.is_file() else None
        if isinstance(name, str):
            found.setdefault(name, []).append(f"{SOURCE_GROUP}={opt}")
    return found


def _list() -> int:
    from treelit.components import all_registries

    options = _group_options()
    sources = _source_options(options.get(SOURCE_GROUP, []))
    for kind, reg in all_registries().items():
        how = SELECT.get(kind)
        group = kind if how == "" else None
        opts = options.get(group, []) if group else []
        if kind == "data_source":
            choose = (f"{' or '.join(o for v in sources.values() for o in v)}, the data options that stream it; "
                      f"a plugin's: {SOURCE_GROUP}=stream {SOURCE_GROUP}.{SOURCE_KEY}=NAME")
        else:
            choose = f"{kind}=NAME" if group else (f"{how}=NAME" if how else COMMANDS.get(kind, "library use"))
        print(f"{kind}  (select with {choose})")
        names = set()
        for e in reg.entries():
            names.add(e.name)
            if kind == "data_source":
                hint = f"  [{', '.join(sources[e.name])}]" if e.name in sources else \
                    f"  [{SOURCE_GROUP}=stream {SOURCE_GROUP}.{SOURCE_KEY}={e.name}]"
            else:
                hint = "" if not group or e.name in opts else f"  [no config file: {group}.{NAME_KEY.get(kind, 'name')}={e.name}]"
            print(f"  {e.name:<26} {e.source}{hint}")
        presets = [o for o in opts if o not in names]
        if presets:
            print(f"  config presets: {', '.join(presets)}")
    for group, opts in options.items():  # the config groups that are not registry kinds
        if group not in all_registries() and opts:
            print(f"{group}  (select with {group}=NAME)")
            print(f"  config options: {', '.join(opts)}")
    return 0


def _detect_builder(path: str) -> str:
    from treelit.data.records import DataError, iter_file

    for item in iter_file(path):
        if isinstance(item, DataError):
            raise item
        rec = item.data
        branches = rec.get("branches") if isinstance(rec, dict) else None
        chat = isinstance(rec, dict) and ("messages" in rec or "traj" in rec or (
            isinstance(branches, list) and any(isinstance(b, dict) and "messages" in b for b in branches)))
        return "chat" if chat else "sequences"
    return "sequences"


def _resolve_data_paths(paths: List[str]) -> List[str]:
    """The data files of ``paths`` as ``data=stream`` expands them (files, directories, globs;
    :class:`~treelit.data.sources.FileSource`), where a name that is none of those may be a
    bundled data file (``synthetic_agentic.jsonl.gz``)."""
    from treelit.cli.config import ConfigError, bundled_path
    from treelit.data.records import DataError
    from treelit.data.sources import FileSource

    items = []
    for p in paths:
        if not Path(p).expanduser().exists() and not any(c in p for c in "*?["):
            try:
                p = bundled_path(p)
            except ConfigError:
                raise FileNotFoundError(2, "no such data file (nor a bundled one of that name)", p) from None
        items.append(p)
    try:
        return FileSource(items).shards()
    except DataError as exc:  # its messages name the training option; here the paths are arguments
        raise DataError(str(exc).replace("data.source.paths: ", "", 1)) from None


def _stats(paths: List[str], builder: str, tokenizer: Optional[str], group_key: Optional[str],
           processor: Optional[str] = None) -> int:
    from treelit.builders.base import make_tree_builder
    from treelit.data.records import DataError
    from treelit.data.stats import stream_stats

    files = _resolve_data_paths(paths)
    name = _detect_builder(files[0]) if builder == "auto" else builder
    options = {}
    if name == "chat":
        from treelit.data.tokenizers import qwen_tokenizer_dir

        # a vision checkpoint's folder has the tokenizer with its image tokens
        options["tokenizer_path"] = tokenizer or processor or qwen_tokenizer_dir()
    if processor:
        options["processor_path"] = processor
    if group_key:
        options["group_key" if name == "chat" else "key"] = group_key
    try:
        stats = stream_stats(files, make_tree_builder(name, **options))  # streamed: any size, progress bar
    except DataError as exc:  # the builders name the training option; here it is --processor
        raise DataError(str(exc).replace("set tree_builder.processor_path to", "pass --processor with")
                        .replace("tree_builder.processor_path", "--processor")) from None
    print(f"{'file':>16}: {files[0]}" if len(files) == 1 else f"{'files':>16}: {len(files):,} ({files[0]} ... {files[-1]})")
    print(f"{'builder':>16}: {name}" + (f" (tokenizer {options['tokenizer_path']})" if name == "chat" else "")
          + (f" (processor {processor})" if processor else ""))
    for k, v in stats.items():
        print(f"{k:>16}: {v:.4f}" if isinstance(v, float) else f"{k:>16}: {v:,}")
    return 0


def main(argv=None) -> int:
    p = OneLineParser(prog="treelit", description="treelit utilities")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="list registered components (built-in and plugins) and how to select them")
    st = sub.add_parser("stats", help="tree statistics of a data file (or of a bundled one, by name)")
    st.add_argument("path", nargs="+", help="data files (.jsonl/.json/.parquet, .gz for JSON), directories, "
                    "globs ('shards/*.jsonl.gz', quoted) as data=stream takes them, or a bundled file's name")
    st.add_argument("--builder", default="auto", help="auto (chat for conversations, else sequences), "
                    "sequences, groups, chat, or a plugin's tree builder")
    st.add_argument("--tokenizer", default=None, help="chat data: a Hugging Face tokenizer directory "
                    "(default: the bundled Qwen2 BPE)")
    st.add_argument("--group-key", default=None, help="records sharing this field form one tree "
                    "(chat and groups builders; e.g. task_id for tau-bench)")
    st.add_argument("--processor", default=None, metavar="DIR", help="records with images: a vision checkpoint's "
                    "folder (its image processor; for chat data also its tokenizer unless --tokenizer is given)")
    args = p.parse_args(argv)
    try:
        if args.cmd == "list":
            return _list()
        return _stats(args.path, args.builder, args.tokenizer, args.group_key, args.processor)
    except Exception as exc:
        from treelit.cli.console import full_error_requested, user_error_message

        msg = user_error_message(exc)
        if msg is None or full_error_requested():
            raise
        print(f"treelit {args.cmd}: error: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
