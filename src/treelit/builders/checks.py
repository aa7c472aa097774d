"""Per-record and per-tree checks of the :class:`~treelit.builders.assemble.Assembler`.

Each check raises a :class:`~treelit.data.records.DataError` whose message starts with the
record's ``file:line`` and names the field, so that a user can fix the record (or
``on_error=skip`` can skip it) before anything trains on it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from treelit.data.records import DataError, finite_number
from treelit.rl.tree_node import TREE_NODE
from treelit.tree.routing import check_routing_model, check_routing_shape, decode_routing
from treelit.tree.token_tree import TreeInputError

__all__ = ["check_limits", "check_live_routing", "check_needs", "check_pairs", "pinned", "lines"]

log = logging.getLogger(__name__)


def lines(encs: Sequence[Any]) -> str:
    """The records of a group, for messages: the first one's source (and how many more)."""
    srcs = [e.rec.source for e in encs]
    return srcs[0] if len(srcs) == 1 else f"{srcs[0]} (and {len(srcs) - 1} more records of its group)"


QWEN_VOCAB_MODEL = ("qwen2_5_tiny_qwen_vocab", 151_936)  # the config preset with the Qwen2/2.5 vocabulary


def _vocab_hint(tokenizer: Any) -> str:
    """For data tokenized by the builder (chat): the tokenizer's vocabulary and a model with it."""
    if tokenizer is None:
        return ""
    try:
        n = len(tokenizer)
    except TypeError:
        return ""
    name, size = QWEN_VOCAB_MODEL
    preset = f"model={name} (the Qwen2/2.5 vocabulary) or " if n <= size else ""
    return (f"; the data is tokenized with tree_builder.tokenizer_path, a vocabulary of {n:,} ids: use a model "
            f"with that vocabulary, {preset}your checkpoint (model.hf_checkpoint=DIR)")


def check_limits(src: str, branches: List[Dict[str, Any]], limits, tokenizer: Any = None) -> None:
    """Token ids inside the model's vocabulary, branches no longer than its context.
    ``tokenizer``: the one that tokenized the data (chat builder), named in the error."""
    V, L = limits.vocab_size, limits.max_seq_len
    for br in branches:
        ids = br["input_ids"]
        where = br["_where"]
        if V is not None:
            top = max(ids)
            if top >= V:
                pos = ids.index(top)
                field = br.get("_ids", f"{where}.input_ids[{pos}]")
                raise DataError(f"{src}: {field}: token id {top} (position {pos}) is outside the model's "
                                f"vocabulary (size {V}){_vocab_hint(tokenizer)}")
        if L is not None and len(ids) > L:
            raise DataError(f"{src}: {where}: {len(ids)} tokens, more than the model's max_seq_len {L}; "
                            "raise the model's max_seq_len or truncate the data")
        if getattr(limits, "routing", None) is not None:
            check_replay_routing(src, br, limits.routing)


def check_replay_routing(src: str, br: Dict[str, Any], routing: Tuple[int, int, int]) -> None:
    """model.moe.routing=replay: the branch has ``routed_experts`` that fit the model (MoE layers,
    expert ids, top_k); the decoded array replaces the field (the tree builder reads it)."""
    field = f"{br['_where']}.routed_experts"
    if br.get("routed_experts") is None:
        raise DataError(f"{src}: {field}: model.moe.routing=replay needs the sampler's routing on every branch "
                        "(or model.moe.routing=live)")
    layers, experts, top_k = routing
    try:
        arr = decode_routing(br["routed_experts"], field)
        check_routing_shape(arr, len(br["input_ids"]), field)
        check_routing_model(arr, layers, experts, top_k, field)
    except TreeInputError as exc:
        raise DataError(f"{src}: {exc}") from None
    br["routed_experts"] = arr


def check_live_routing(src: str, branches: List[Dict[str, Any]], limits) -> None:
    """model.moe.routing=live and a record with ``routed_experts``: the recorded routing is not
    used (one warning per run, naming the first such record), but its expert ids are still
    checked against the model's experts (``limits.experts``): an id outside them is an error, as
    under replay - a sampler that recorded another model's routing is worth knowing about."""
    if not limits.said:
        limits.said.append("live routing")
        first = next(br for br in branches if br.get("routed_experts") is not None)
        log.warning("%s: %s.routed_experts: the records' recorded MoE routing is not used under "
                    "model.moe.routing=live (each MoE layer routes by its own router); set model.moe.routing=replay "
                    "to train on the sampler's experts (said once for the whole data)", src, first["_where"])
    experts = limits.experts
    if not experts:
        return
    for br in branches:
        if br.get("routed_experts") is None:
            continue
        field = f"{br['_where']}.routed_experts"
        try:
            arr = decode_routing(br["routed_experts"], field)
        except TreeInputError as exc:
            raise DataError(f"{src}: {exc}") from None
        if arr.size and arr.max() >= experts:
            t, layer = (int(x) for x in np.argwhere(arr >= experts)[0][:2])
            raise DataError(f"{src}: {field}: expert id {int(arr[t, layer].max())} at token {t}, MoE layer {layer} "
                            f"is out of range (the model has {experts} experts: 0..{experts - 1})")


def _target_without(br: dict, field: str):
    """The first target position (``loss_mask`` 1, never position 0) of branch ``br`` whose
    per-token ``field`` has no value; None when every target has one."""
    vals, mask = br.get(field), br.get("loss_mask")
    for t in range(1, len(br["input_ids"])):
        if (mask is None or mask[t]) and (vals is None or vals[t] is None):
            return t
    return None


def check_needs(rec, branches: List[Dict[str, Any]], limits, est: Optional[str], builder) -> None:
    """What the objective (and the advantage estimator) read from the record is there."""
    needs, src, obj = limits.needs or {}, rec.source, limits.objective
    if est == TREE_NODE:  # every leaf's reward; the advantages are the tree's
        for br in branches:
            if br.get("advantage") is not None:
                raise DataError(f"{src}: {br['_where']}.advantage: tree_builder.advantage=tree_node computes every "
                                "token's advantage from the branches' rewards; drop the record's advantage or the option")
            if not finite_number(br.get("reward")):
                raise DataError(f"{src}: {br['_where']}.reward: tree_builder.advantage=tree_node needs a finite reward "
                                f"on every branch, got {br.get('reward')!r}")
    elif est is not None:
        if builder.reward_per_record:
            r = builder.reward_of(rec)
            if not finite_number(r):
                raise DataError(f"{src}: reward: must be a finite number (tree_builder.advantage={est}), got {r!r}")
        else:
            for br in branches:
                if br.get("advantage") is None and not finite_number(br.get("reward")):
                    raise DataError(f"{src}: {br['_where']}.reward: tree_builder.advantage={est} needs a finite "
                                    f"reward on every branch without an advantage, got {br.get('reward')!r}")
    elif needs.get("reward"):  # GAE with a critic: rewards, not advantages
        for br in branches:
            if br.get("token_rewards") is None and not finite_number(br.get("reward")):
                raise DataError(f"{src}: {br['_where']}.reward: {obj} with a critic needs a finite 'reward' (or "
                                f"'token_rewards') on every branch for GAE, got {br.get('reward')!r}")
    elif needs.get("advantage"):
        for br in branches:
            if br.get("advantage") is None:
                raise DataError(
                    f"{src}: {br['_where']}.advantage: {obj} needs an advantage on every branch (give "
                    "'advantage', or 'reward' with tree_builder.advantage=grpo|rloo|reinforce_pp|...)"
                )
    if needs.get("ref_logprobs"):
        for br in branches:
            t = _target_without(br, "ref_logprobs")
            if t is not None:
                raise DataError(f"{src}: {br['_where']}.ref_logprobs: {obj} needs a reference log-prob for "
                                f"every target token; position {t} has none (or use objective.reference=initial)")
    if needs.get("behavior_logprobs"):
        for br in branches:
            t = _target_without(br, "old_logprobs")
            if t is not None:
                raise DataError(f"{src}: {br['_where']}.old_logprobs: {obj} with a behaviour correction needs the "
                                f"sampler's log-prob for every target token; position {t} has none")
    if needs.get("pairs"):
        for br in branches:
            if br.get("pair") is None or not isinstance(br.get("chosen"), bool):
                raise DataError(f"{src}: {br['_where']}.pair: {obj} needs 'pair' (a string or an integer) and "
                                f"'chosen' (true/false) on every branch")


def pinned(exc: DataError, members: List[Tuple[Any, int]]) -> DataError:
    """Re-address a tree-level error to the record(s) and field(s) of the branches at fault.

    ``exc.branches``: the branches at fault (the message starts with the last one's record;
    ``{other}`` in ``exc.detail`` names the first); ``exc.others`` (optional): branches named
    as ``{other}`` without being at fault. The result's ``at_fault`` lists the records of the
    branches at fault (``on_error=skip`` skips those); empty when the error is the tree's."""
    idx = [b for b in getattr(exc, "branches", ()) if 0 <= b < len(members)]
    if not idx:
        out = DataError(f"{lines([e for e, _ in members])}: {exc.detail if hasattr(exc, 'detail') else exc}")
        out.at_fault = []
        return out
    named = [b for b in getattr(exc, "others", ()) if 0 <= b < len(members) and b not in idx]
    where = [f"{members[b][0].rec.source} {members[b][0].branches[members[b][1]]['_where']}" for b in idx + named]
    e, j = members[idx[-1]]
    other = next((w for b, w in zip(idx + named, where) if b != idx[-1]), "another branch")
    detail = getattr(exc, "detail", str(exc)).replace("{other}", other)
    out = DataError(f"{e.rec.source}: {e.branches[j]['_where']}.{detail}", branches=())
    out.at_fault = list({id(members[b][0]): members[b][0] for b in idx}.values())
    return out


def check_pairs(members: List[Tuple[Any, int]], objective: str) -> None:
    """Every DPO pair of a tree has exactly one chosen and one rejected branch."""
    pairs: "OrderedDict[Any, List[Tuple[Any, int]]]" = OrderedDict()
    for e, j in members:
        pairs.setdefault(e.branches[j]["pair"], []).append((e, j))
    for p, ms in pairs.items():
        flags = sorted(bool(e.branches[j]["chosen"]) for e, j in ms)
        if flags != [False, True]:
            at = ", ".join(f"{e.rec.source} {e.branches[j]['_where']}" for e, j in ms)
            e, j = ms[-1]
            err = DataError(f"{e.rec.source}: {e.branches[j]['_where']}.pair: {objective} needs exactly one chosen and "
                            f"one rejected branch per pair in a tree; pair {p!r} has {len(ms)} branch(es) with chosen="
                            f"{[bool(e.branches[j]['chosen']) for e, j in ms]} ({at})")
            err.at_fault = list({id(e): e for e, _ in ms}.values())
            raise err
