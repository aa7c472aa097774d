"""Records in, trees out, one record at a time, every failure pinned to its record.

The :class:`Assembler` runs any :class:`~treelit.builders.base.TreeBuilder` the same
way in memory and on a stream:

1. **Per record**: the builder's structural check, its encoding into token branches
   (the chat builder renders and tokenizes here), the model's limits (token ids inside
   the vocabulary, branches no longer than the context) and what the objective needs
   (an advantage or a reward on every branch, reference log-probs on every target,
   DPO pairs). A failure names the record's file, line and field; with
   ``on_error=skip`` the record is skipped and counted *before* it can touch a group's
   advantages or a tree.
2. **Units**: records whose branches share a tree key or an advantage-group key are
   held together. A unit is complete at the end of the data, or on a stream once none
   of its keys has been seen for ``window`` records; a key that comes back after its
   unit was completed is an error (groups must lie within the window).
3. **Per unit**: advantages from rewards (within groups, or over the whole batch for
   batch-scoped estimators such as ``reinforce_pp``), then one tree per tree key. An
   error here (disagreeing log-probs of two records, a broken DPO pair, a group whose
   advantages are not finite) names the records' lines. ``skip`` skips the records at
   fault (both of two that disagree) and builds what remains again, as the units it now
   forms, advantages computed over the records left; an error of the unit itself (no
   record at fault) skips all its records, the message naming every one.

Group keys keep their JSON type (``7`` and ``"7"`` are different groups). Records
without a key are told apart by their position, never by their ``id``; where an ``id``
would have been taken as a key, a duplicate is refused naming both lines. Fields the
objective does not use are dropped before building (an SFT run does not fail on
disagreeing rollout log-probs it would never read).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from treelit.builders.checks import check_limits, check_live_routing, check_needs, check_pairs, lines, pinned
from treelit.data.records import DataError, ReadStats, Record
from treelit.rl.advantages import AdvantageError, compute_advantages, estimator_scope, groups_of
from treelit.rl.tree_node import TREE_NODE, apply_node_credit
from treelit.tree.token_tree import TokenTree

if TYPE_CHECKING:  # annotations only: the interface (builders.base) runs this module, not the reverse
    from treelit.builders.base import TreeBuilder

__all__ = ["Assembler", "BuiltTree", "Limits"]

log = logging.getLogger(__name__)


@dataclass
class BuiltTree:
    """A tree and where it came from: ``source`` is its first record's, ``positions`` the
    positions of all its records in the data source (used to resume a stream)."""

    id: str
    tree: TokenTree
    source: str
    positions: List[Any] = field(default_factory=list)
    sources: List[str] = field(default_factory=list)
    unit: List[Any] = field(default_factory=list)  # positions of the records its advantages were computed over
    unit_index: int = 0  # its place among the trees of that unit
    epoch: int = 0  # the data epoch a stream served it in


@dataclass
class Limits:
    """What every tree must satisfy: the model's ``vocab_size`` and ``max_seq_len`` and the
    objective's ``needs`` (:meth:`~treelit.objectives.Objective.data_needs`; None: unknown,
    every field is kept and nothing is required); ``routing``: the MoE routing replay needs
    (:meth:`~treelit.builders.checks.check_limits`)."""

    vocab_size: Optional[int] = None
    max_seq_len: Optional[int] = None
    needs: Optional[Dict[str, bool]] = None
    objective: str = "the objective"
    # model.moe.routing=replay: (MoE layers, experts, top_k) every branch's routed_experts must fit
    # (None: the model routes live; with ``needs`` known, recorded routing is then dropped unread)
    routing: Optional[Tuple[int, int, int]] = None
    # the model's experts per MoE layer (None: no MoE layers, or not known): under live routing a
    # record's routed_experts is not used, but an expert id outside the model is still an error
    experts: Optional[int] = None
    # keep and check recorded routing without a model to fit (treelit stats: every field decoded as training would)
    keep_routing: bool = False
    # (one warning per run that live routing ignores recorded routing: set once it was given)
    said: List[str] = field(default_factory=list, compare=False, repr=False)


class _Own:
    """The key of a record's own tree / group (records are told apart by position)."""

    __slots__ = ("index", "source")

    def __init__(self, index: int, source: str) -> None:
        self.index, self.source = index, source

    def __hash__(self) -> int:
        return hash(("own", self.index))

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Own) and other.index == self.index

    def __repr__(self) -> str:
        return f"<the record at {self.source}>"


@dataclass
class _Enc:
    rec: Record
    index: int
    branches: List[Dict[str, Any]]
    tree_keys: List[Any]
    adv_keys: List[Any]


class _Unit:
    __slots__ = ("encs", "keys", "last")

    def __init__(self) -> None:
        self.encs: List[_Enc] = []
        self.keys: set = set()
        self.last = -1


_BATCH = ("__batch__",)


def _check_tree_node(needs: Dict[str, bool], objective: str) -> None:
    """``tree_builder.advantage=tree_node`` needs an objective that weighs each token by its own advantage."""
    if needs.get("reward"):
        raise DataError(f"tree_builder.advantage=tree_node: {objective} with a critic computes GAE advantages from "
                        "the critic's values, which would replace the node credit (itself a baseline: the mean reward "
                        "of the leaves below each node); use one of the two")
    if needs.get("advantage") and not needs.get("token_advantage"):
        raise DataError(f"tree_builder.advantage=tree_node: {objective} weighs each branch by one advantage, not each "
                        "token by its own; use objective=ppo or objective=grpo")


def _all_groups(n: int) -> str:
    return "the only group" if n == 1 else f"all {n} groups"


class Assembler:
    """Args:
        builder: the tree builder.
        on_error: ``raise`` or ``skip`` (count in ``stats`` and go on).
        window: on a stream, a unit is complete once none of its keys has been seen for this
            many records (None: at :meth:`flush` only, i.e. in memory).
        limits: :class:`Limits` (model and objective); default: none.
        stats: a :class:`~treelit.data.records.ReadStats` the skips are counted in.
        name: the data's name in messages about the whole data (e.g. its path).
        branch_hook: ``hook(record, branches)``: each record's encoded branches, changed before
            any check (None back: the record is left out); e.g. per-token staleness
            (:mod:`treelit.lightning.token_staleness`).
    """

    def __init__(self, builder: TreeBuilder, *, on_error: str = "raise", window: Optional[int] = None,
                 limits: Optional[Limits] = None, stats: Optional[ReadStats] = None, name: str = "data",
                 branch_hook: Optional[Callable[[Record, List[Dict[str, Any]]], Optional[List[Dict[str, Any]]]]] = None
                 ) -> None:
        self.b = builder
        self.branch_hook = branch_hook
        self.name = name
        self.on_error = on_error
        self.window = window
        self.limits = limits or Limits()
        self.stats = stats if stats is not None else ReadStats()
        needs = self.limits.needs
        self.estimator = builder.advantage if (needs is None or needs.get("advantage")) else None
        self.scope = None
        if builder.advantage == TREE_NODE and needs is not None:
            _check_tree_node(needs, self.limits.objective)
        if self.estimator == TREE_NODE:
            self.scope = "tree"  # computed on each merged tree (treelit.rl.tree_node)
        elif self.estimator is not None:
            self.scope = estimator_scope(self.estimator)
            if self.scope == "batch" and window is not None:
                raise DataError(
                    f"tree_builder.advantage={self.estimator} normalises over the whole batch, which a stream of "
                    "unbounded length does not have: give advantages in the records, use a group estimator "
                    "(grpo, rloo, reinforce_pp_baseline), or read the data in memory"
                )
        self.n = 0
        self.units: "OrderedDict[int, _Unit]" = OrderedDict()
        self.key_unit: Dict[Any, _Unit] = {}
        self.closed: "OrderedDict[Any, str]" = OrderedDict()
        self.max_closed = max(100_000, 4 * (window or 0))
        self.ids: "OrderedDict[Any, str]" = OrderedDict()
        self.groups = 0
        self.singletons = 0
        self._warned = False

    # public -------------------------------------------------------------------------------
    def add(self, rec: Record, index: Optional[int] = None) -> List[BuiltTree]:
        """Take one record; return the trees of the units it completed. ``index``: the record's
        place in the stream (default: the next one; given when open units are restored)."""
        if index is None:
            index = self.n
        self.n = max(self.n, index + 1)
        try:
            enc = self._encode(rec, index)
        except DataError as exc:
            self._fail(exc, 1)
            return self._close_stale(index)
        if enc is None:  # the branch hook left the whole record out
            return self._close_stale(index)
        shared = {k for k in enc.tree_keys + enc.adv_keys if not isinstance(k, _Own)}
        if self.scope == "batch":
            shared.add(_BATCH)
        units = []
        for k in shared:
            u = self.key_unit.get(k)
            if u is not None and all(u is not v for v in units):
                units.append(u)
        if not shared:
            unit = _Unit()
            unit.encs.append(enc)
            return self._close_stale(index) + self._close(unit)
        unit = units[0] if units else _Unit()
        for other in units[1:]:
            unit.encs += other.encs
            unit.keys |= other.keys
            self.units.pop(id(other), None)
        unit.encs.append(enc)
        unit.keys |= shared
        unit.last = index
        for k in unit.keys:
            self.key_unit[k] = unit
        self.units[id(unit)] = unit
        self.units.move_to_end(id(unit))
        return self._close_stale(index)

    def flush(self) -> List[BuiltTree]:
        """Complete every open unit (the end of the data, of a shard, or of one rollout file)."""
        out: List[BuiltTree] = []
        for unit in sorted(self.units.values(), key=lambda u: min(e.index for e in u.encs)):
            if self.window is not None:
                self._remember_closed(unit)
            out += self._close(unit)
        self.units.clear()
        self.key_unit.clear()
        return out

    # resumable state (streams) ------------------------------------------------------------------
    def state(self) -> Dict[str, Any]:
        """What a stream checkpoint needs: counters, recently completed keys, recent ids and the
        open units as the positions of their records (re-read on :meth:`load`)."""
        return {
            "n": self.n, "groups": self.groups, "singletons": self.singletons, "warned": self._warned,
            "closed": [[k, v] for k, v in self.closed.items()],
            "ids": [[k, v] for k, v in self.ids.items()],
            "open": [[[e.index, e.rec.position] for e in sorted(u.encs, key=lambda e: e.index)]
                     for u in self.units.values()],
        }

    def load(self, state: Dict[str, Any], record_at) -> None:
        """Restore :meth:`state`; ``record_at(position)`` re-reads a record."""
        self.units.clear()
        self.key_unit.clear()
        self.closed = OrderedDict((k, v) for k, v in state["closed"])
        self.ids = OrderedDict((k, v) for k, v in state["ids"])
        for unit in state["open"]:
            for index, position in unit:
                rec = record_at(position)
                if isinstance(rec, DataError):
                    raise rec
                rec.position = position
                self.add(rec, index)
        self.n = int(state["n"])
        self.groups, self.singletons, self._warned = int(state["groups"]), int(state["singletons"]), bool(state["warned"])

    def _remember_closed(self, unit: "_Unit") -> None:
        for k in unit.keys:
            self.key_unit.pop(k, None)
            if k is not _BATCH:
                self.closed[k] = unit.encs[-1].rec.source
                self.closed.move_to_end(k)
        while len(self.closed) > self.max_closed:
            self.closed.popitem(last=False)

    def report(self) -> None:
        """Warn (once) about singleton advantage groups; refuse when every group is one."""
        if not self.groups:
            return
        key = self.b.group_field
        if self.singletons == self.groups:
            if hasattr(self.b, "group_key") and self.b.group_key is None:
                raise DataError(
                    f"{self.name}: advantage estimator {self.estimator!r}: tree_builder.group_key is not set, so every "
                    "record is a group of one and every advantage would be 0; set tree_builder.group_key to the field "
                    "naming the prompt or task, or use tree_builder.advantage=reinforce_pp (normalised over the batch)"
                )
            raise DataError(
                f"{self.name}: advantage estimator {self.estimator!r}: {_all_groups(self.groups)} (samples sharing '{key}') "
                f"{'has' if self.groups == 1 else 'have'} a single sample, so every advantage would be 0 and training "
                "would have no signal; give the rollouts "
                f"of one prompt the same '{key}' value, or use tree_builder.advantage=reinforce_pp (normalised over "
                "the batch)"
            )
        if self.singletons and not self._warned:
            self._warned = True
            one = self.singletons == 1
            log.warning("%s: advantage estimator %r: %d of %d groups (samples sharing '%s') %s a single sample; "
                        "%s advantage is 0", self.name, self.estimator, self.singletons, self.groups, key,
                        "has" if one else "have", "its" if one else "their")

    # per record ------------------------------------------------------------------------------
    def _encode(self, rec: Record, index: int) -> Optional[_Enc]:
        b, src = self.b, rec.source
        b.validate(rec.data, src)
        branches = b.encode(rec)
        if self.branch_hook is not None and branches:
            branches = self.branch_hook(rec, branches)
            if branches is None:
                return None
        if not branches:
            raise DataError(f"{src}: the record has nothing to train on")
        if (self.limits.vocab_size is not None and self.limits.routing is None  # checked against a live model
                and any(br.get("routed_experts") is not None for br in branches)):
            check_live_routing(src, branches, self.limits)
        needs = self.limits.needs
        if needs is not None:
            drop = [k for k, need in (("advantage", "advantage"), ("old_logprobs", "old_logprobs"),
                                      ("ref_logprobs", "ref_logprobs")) if not needs.get(need)]
            if self.limits.routing is None and not self.limits.keep_routing:
                drop.append("routed_experts")
            for br in branches:
                for k in drop:
                    br.pop(k, None)
        check_limits(src, branches, self.limits, getattr(self.b, "tok", None))  # the chat builder's tokenizer
        check_needs(rec, branches, self.limits, self.estimator, self.b)
        own = _Own(index, src)
        tk = [own if k is None else k for k in b.tree_keys(rec, branches)]
        ak = [own if k is None else k for k in b.advantage_keys(rec, branches)] if self.estimator else []
        for k in set(tk + ak):
            if not isinstance(k, _Own) and k in self.closed:
                raise DataError(
                    f"{src}: {b.group_field}: group {k!r} was already complete (its last record was {self.closed[k]}); "
                    f"on a stream the records of one group must be in one file and within data.group_window="
                    f"{self.window} records of each other (raise data.group_window, or sort the data by group)"
                )
        rid = rec.data.get("id")
        if rid is not None and b.uses_ids(rec, [None if isinstance(k, _Own) else k for k in tk],
                                          [None if isinstance(k, _Own) else k for k in ak]):
            if rid in self.ids:
                raise DataError(
                    f"{src}: id: duplicate id {rid!r} (also at {self.ids[rid]}); records without a "
                    f"'{b.group_field}' are told apart by their id here, so ids must be unique (or give both the "
                    f"same '{b.group_field}' to group them)"
                )
            self.ids[rid] = src
            if self.window is not None and len(self.ids) > 4 * self.window:
                self.ids.popitem(last=False)
        for br in branches:
            br["_record"] = rec.id
        return _Enc(rec, index, branches, tk, ak)

    # per unit --------------------------------------------------------------------------------
    def _close_stale(self, index: int) -> List[BuiltTree]:
        out: List[BuiltTree] = []
        if self.window is None:
            return out
        while self.units:
            unit = next(iter(self.units.values()))
            if index - unit.last <= self.window:
                break
            self.units.popitem(last=False)
            self._remember_closed(unit)
            out += self._close(unit)
        return out

    def _close(self, unit: _Unit) -> List[BuiltTree]:
        """The unit's trees. Under ``on_error=skip`` an error pinned to records (``at_fault``)
        skips those records only, and what remains is built again as the units it now forms
        (advantages over the records left); an error of the whole unit skips all its records."""
        pending = [sorted(unit.encs, key=lambda e: e.index)]
        out: List[BuiltTree] = []
        while pending:
            encs = pending.pop(0)
            try:
                counts = self._fill_advantages(encs) if self.estimator not in (None, TREE_NODE) else (0, 0)
                trees = self._trees(encs)
            except DataError as exc:
                bad = {id(e) for e in getattr(exc, "at_fault", None) or ()}
                rest = [e for e in encs if id(e) not in bad]
                if not bad or not rest or self.on_error == "raise":
                    self._fail(exc, len(encs), encs)
                else:
                    self._fail(exc, len(encs) - len(rest))
                    pending[:0] = self._components(rest)
                continue
            self.groups += counts[0]
            self.singletons += counts[1]
            out += trees
        return out

    def _components(self, encs: List[_Enc]) -> List[List[_Enc]]:
        """``encs`` split into the units they form on their own (records linked by a shared
        tree or advantage-group key), each in stream order."""
        parent = list(range(len(encs)))

        def root(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        first: Dict[Any, int] = {}
        for i, e in enumerate(encs):
            keys = {k for k in e.tree_keys + e.adv_keys if not isinstance(k, _Own)}
            if self.scope == "batch":
                keys.add(_BATCH)
            for k in keys:
                if k in first:
                    parent[root(i)] = root(first[k])
                else:
                    first[k] = i
        comps: "OrderedDict[int, List[_Enc]]" = OrderedDict()
        for i, e in enumerate(encs):
            comps.setdefault(root(i), []).append(e)
        return list(comps.values())

    def _fill_advantages(self, encs: List[_Enc]) -> Tuple[int, int]:
        """Advantages of the branches without one; returns (groups, groups of one sample). Advantages
        filled by an earlier attempt on these records are computed again."""
        for e in encs:
            for br in e.branches:
                if br.pop("_computed_advantage", False):
                    br.pop("advantage", None)
        if self.b.reward_per_record:
            todo = [(e, None) for e in encs]
            rewards = [float(self.b.reward_of(e.rec)) for e in encs]
            keys = [e.adv_keys[0] for e in encs]
        else:
            todo = [(e, j) for e in encs for j, br in enumerate(e.branches) if br.get("advantage") is None]
            rewards = [float(e.branches[j]["reward"]) for e, j in todo]
            keys = [e.adv_keys[j] for e, j in todo]
        if not todo:
            return 0, 0
        counts = (0, 0)
        if self.scope == "group":
            sizes = [len(ix) for ix in groups_of(keys).values()]
            counts = (len(sizes), sum(1 for s in sizes if s == 1))
        try:
            adv = compute_advantages(self.estimator, rewards, keys, key_name=self.b.group_field, check_singletons=False,
                                     **self.b.advantage_options)
        except AdvantageError as exc:
            raise DataError(f"{lines(encs)}: {exc}") from None
        for (e, j), a in zip(todo, adv):
            for br in (e.branches if j is None else [e.branches[j]]):
                br["advantage"] = float(a)
                br["_computed_advantage"] = True
        return counts

    def _trees(self, encs: List[_Enc]) -> List[BuiltTree]:
        groups: "OrderedDict[Any, List[Tuple[_Enc, int]]]" = OrderedDict()
        for e in encs:
            for j, k in enumerate(e.tree_keys):
                groups.setdefault(k, []).append((e, j))
        out = []
        for key, members in groups.items():
            first = members[0][0]
            tree_id = first.rec.id if isinstance(key, _Own) else f"{self.b.group_field}={key!r}"
            branches = [e.branches[j] for e, j in members]
            try:
                built = self.b.tree(branches, tree_id, first.rec.source)
            except DataError as exc:
                raise pinned(exc, members) from None
            if self.estimator == TREE_NODE:
                apply_node_credit(built.tree, [float(br["reward"]) for br in branches], self.b.node_credit)
            recs = list(OrderedDict((id(e), e) for e, _ in members).values())
            built.positions = [e.rec.position for e in recs]
            built.sources = [e.rec.source for e in recs]
            built.unit = [e.rec.position for e in encs]
            built.unit_index = len(out)
            if (self.limits.needs or {}).get("pairs"):
                check_pairs(members, self.limits.objective)
            out.append(built)
        return out

    def _fail(self, exc: DataError, records: int, encs: Optional[List[_Enc]] = None) -> None:
        """Raise, or skip ``records`` records; ``encs``: every record skipped, named in the message
        when there are several (an error of a whole unit)."""
        if self.on_error == "raise":
            raise exc
        if encs is not None and len(encs) > 1:
            exc = DataError(f"{exc} (skipped with it, all {len(encs)} records of its unit: "
                            f"{', '.join(e.rec.source for e in encs)})")
        self.stats.skip(exc, records)
