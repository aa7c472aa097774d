"""The weight files of a checkpoint directory, and their shapes checked against ``config.json``.

A checkpoint directory is often someone else's. Two things are checked before anything
is loaded or allocated:

* the shard names its ``model.safetensors.index.json`` lists must be names inside the
  directory (:func:`treelit.utils.paths.confined`): ``../x.safetensors`` is refused;
* the sizes ``config.json`` states must agree with the weights: a model is allocated
  at the size its config states, so ``vocab_size=62500000`` beside 780 KB of weights
  would try to allocate 16 GB before any weight shape is compared. The shapes come
  from the safetensors headers (no tensor data is read); the embedding, the output
  head, the layer count and the MLP width are compared with ``vocab_size``,
  ``hidden_size``, ``num_hidden_layers`` and ``intermediate_size``. Each of these
  mismatches would fail later anyway (or, for a missing layer, load it randomly
  initialised in transformers); here it is one line naming the key, the config value
  and the weight shape. Checkpoints in ``pytorch_model*.bin`` files are not checked
  (their shapes are not in a header).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from safetensors import safe_open

from treelit.models.errors import CheckpointError
from treelit.utils.paths import confined

__all__ = ["SAFE_INDEX", "BIN_INDEX", "weight_files", "header_shapes", "check_shapes", "check_weight_shapes"]

SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"


def weight_files(path: Path) -> Tuple[List[Path], Optional[Path], Optional[Dict[str, str]]]:
    """``(files, index file, weight map)`` of a checkpoint directory: the shards an index
    file lists (sharded checkpoints; the index and its map are returned), else
    ``model.safetensors``, else every ``*.safetensors`` / ``pytorch_model*.bin``."""
    for index_name in (SAFE_INDEX, BIN_INDEX):
        index = path / index_name
        if not index.is_file():
            continue
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()), key=str)
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: not a valid index file ({exc})") from None
        files = [confined(path, s, f"{index}: shard", error=CheckpointError) for s in shards]
        missing = [s for s, f in zip(shards, files) if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index}: shard files {', '.join(missing[:4])} are missing")
        return files, index, weight_map
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"], None, None
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors or pytorch_model*.bin weights found")
    return files, None, None


def header_shapes(files: Sequence[Path]) -> Optional[Dict[str, List[int]]]:
    """Every weight's shape from the safetensors headers (no tensor data read); ``None``
    when a file is not safetensors."""
    if any(f.suffix != ".safetensors" for f in files):
        return None
    shapes: Dict[str, List[int]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for key in h.keys():
                    shapes[key] = list(h.get_slice(key).get_shape())
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"{f}: cannot read weights ({type(exc).__name__}: {exc})") from None
    return shapes


_EMBED_RE = re.compile(r"^(?P<prefix>(?:\w+\.)*?)(?:embed_tokens|embeddings|tok_embeddings|wte|word_embeddings)\.weight$")
_HEADS = ("lm_head.weight", "output.weight")
_KEYS = {"vocab": ("vocab_size",), "hidden": ("hidden_size", "embed_dim", "d_model", "n_embd"),
         "layers": ("num_hidden_layers", "num_layers", "n_layer"), "mlp": ("intermediate_size", "intermediate_dim")}


def _setting(cfg: Dict[str, Any], kind: str, label: str) -> Tuple[Optional[str], Optional[int]]:
    for key in _KEYS[kind]:
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return f"{label}{key}", value
    return None, None


def check_shapes(cfg: Dict[str, Any], shapes: Dict[str, List[int]], where: str, label: str = "") -> None:
    """:class:`CheckpointError` ``"<where> vocab_size=V but <key> has shape [...]"`` when the
    sizes in ``cfg`` (a ``config.json`` dict; ``label`` prefixes its key names) disagree with
    the weight ``shapes``."""

    def refuse(name: str, value: int, key: str, what: str = "") -> None:
        shape = what or f"has shape {shapes[key]}"
        raise CheckpointError(f"{where} {name}={value} but {key} {shape}")

    (vocab_name, vocab), (hidden_name, hidden) = _setting(cfg, "vocab", label), _setting(cfg, "hidden", label)
    embeds = [k for k in shapes if _EMBED_RE.match(k) and len(shapes[k]) == 2]
    prefix = None
    if len(embeds) == 1:
        key = embeds[0]
        prefix = _EMBED_RE.match(key).group("prefix")
        if vocab_name and shapes[key][0] != vocab:
            refuse(vocab_name, vocab, key)
        if hidden_name and shapes[key][1] != hidden:
            refuse(hidden_name, hidden, key)
    for key in _HEADS:
        if vocab_name and key in shapes and len(shapes[key]) == 2 and shapes[key][0] != vocab:
            refuse(vocab_name, vocab, key)
    if prefix is None:
        # no embedding found by name (left out, or a family naming it otherwise): the model still
        # allocates vocab x hidden values for one, which a complete checkpoint holds among its weights
        total = sum(math.prod(s) for s in shapes.values())
        if vocab_name and hidden_name and vocab * hidden > total:
            raise CheckpointError(f"{where} {vocab_name}={vocab} and {hidden_name}={hidden} make an embedding of "
                                  f"{vocab * hidden} values, but the weights hold {total} values in all")
        return
    blocks = re.compile(rf"^{re.escape(prefix)}(layers|h|blocks)\.(\d+)\.")
    found: Dict[str, set] = {}
    for key in shapes:
        m = blocks.match(key)
        if m:
            found.setdefault(m.group(1), set()).add(int(m.group(2)))
    layers_name, layers = _setting(cfg, "layers", label)
    if layers_name and len(found) == 1:
        (group, indices), = found.items()
        if layers > len(indices):
            refuse(layers_name, layers, f"{prefix}{group}",
                   f"holds {len(indices)} layers ({prefix}{group}.{min(indices)} to {prefix}{group}.{max(indices)})")
    mlp_name, width = _setting(cfg, "mlp", label)
    mlp = re.compile(rf"^{re.escape(prefix)}(?:layers|h|blocks)\.\d+\.mlp\.(?:gate_proj|up_proj|w1|w3)\.weight$")
    for key in sorted(shapes):
        if mlp_name and mlp.match(key) and len(shapes[key]) == 2 and shapes[key][0] != width:
            refuse(mlp_name, width, key)


def check_weight_shapes(cfg: Dict[str, Any], files: Sequence[Path], cfg_file: Path) -> None:
    """:func:`check_shapes` of a checkpoint directory's ``config.json`` dict against the
    headers of its weight ``files`` (treelit's own format: its ``treelit_config``)."""
    shapes = header_shapes(files)
    if shapes is None:
        return
    if cfg.get("model_type") == "treelit" and isinstance(cfg.get("treelit_config"), dict):
        check_shapes(cfg["treelit_config"], shapes, str(cfg_file), "treelit_config.")
    else:
        check_shapes(cfg, shapes, str(cfg_file))
