"""Per-token staleness: which policy version sampled each token, and what a stale token costs.

A raw branch may carry ``policy_versions``: one entry per token of ``input_ids``, the
version of the weights that sampled it (null for tokens not sampled: the prompt, tool
output). A chat record states it per assistant turn (``"policy_version"`` on an assistant
message), which the chat builder spreads over that turn's tokens. A branch without it takes
its record's ``policy_version`` for every trained token (``loss_mask`` 1; no version at
all: version 0). A token's staleness is the trainer's
version minus its own; only trained tokens with a version are counted.

``data.staleness_policy`` says what ``data.max_staleness=S`` does with a token more than S
versions behind:

* ``skip_file`` (default): the whole file is skipped (or refused, ``data.on_stale``), judged
  by the oldest version it states (:class:`~treelit.lightning.staleness.StalenessGate`).
* ``drop_tokens``: the stale tokens leave the loss (their ``loss_mask`` becomes 0 on that
  branch); the rest of the branch trains. The tree still merges exactly: branches that
  share a token may differ in its mask.
* ``drop_branch``: a branch holding a stale trained token is left out; a record left with no
  branch is left out.

Versions of a shared token that disagree between branches (records may disagree, though a
truly shared prefix was sampled once) are not merged: each branch is judged by its own
versions, so the token leaves the loss of the branches that call it stale and stays in
those that call it fresh, which the tree merges exactly (per-branch masks).

A per-token version newer than the trainer's is a data error naming the record and field (a
version in the future: the sampler and the trainer disagree on what was published); a
record-level ``policy_version`` ahead stays a warning, counted as staleness 0, as before.
The work is done on the host, on each record's encoded branches (an
:class:`~treelit.builders.assemble.Assembler` branch hook), before its tree is built.

Metrics of each trained file: ``staleness/tokens_0`` .. ``staleness/tokens_3`` and
``staleness/tokens_4plus`` (trained tokens by staleness, before any drop),
``staleness/tokens_dropped`` (trained tokens that left the loss: the stale ones under
``drop_tokens``, every trained token of a dropped branch under ``drop_branch``) and
``staleness/branches_dropped``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from treelit.data.records import DataError, Record

__all__ = ["POLICIES", "BUCKETS", "TokenStaleness", "oldest_version", "token_versions"]

POLICIES = ("skip_file", "drop_tokens", "drop_branch")
BUCKETS = 4  # staleness/tokens_0 .. tokens_3, then tokens_4plus


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"data.staleness_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    return policy


def _record_version(data: Any) -> int:
    v = data.get("policy_version") if isinstance(data, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def token_versions(branches: List[Dict[str, Any]], record_version: int) -> List[List[Optional[int]]]:
    """Per encoded branch (``input_ids``, ``loss_mask``, optional ``policy_versions``), per token:
    the version that sampled it, None for a token that is not trained or has no version; a
    branch without ``policy_versions`` gives its trained tokens ``record_version``."""
    out: List[List[Optional[int]]] = []
    for br in branches:
        n = len(br["input_ids"])
        mask = br.get("loss_mask")
        trained = [bool(m) for m in mask] if isinstance(mask, list) and len(mask) == n else [True] * n
        trained[0] = False  # position 0 is never a target
        per = br.get("policy_versions")
        if isinstance(per, list) and len(per) == n:
            out.append([v if t else None for v, t in zip(per, trained)])
        else:
            out.append([record_version if t else None for t in trained])
    return out


def oldest_version(data: Any) -> Optional[int]:
    """The oldest per-token version a record states (raw branches' ``policy_versions``, chat
    assistant messages' ``policy_version``), None when it states none. Malformed values are
    left to the record checks."""
    if not isinstance(data, dict):
        return None
    found: List[int] = []
    convs = [data.get("messages"), data.get("traj")]
    branches = data.get("branches")
    for br in branches if isinstance(branches, list) else []:
        if isinstance(br, dict):
            per = br.get("policy_versions")
            if isinstance(per, list):
                found += [v for v in per if isinstance(v, int) and not isinstance(v, bool)]
            convs.append(br.get("messages"))
    for msgs in convs:
        if isinstance(msgs, list):
            found += [m["policy_version"] for m in msgs if isinstance(m, dict) and m.get("role") == "assistant"
                      and isinstance(m.get("policy_version"), int) and not isinstance(m["policy_version"], bool)]
    return min(found) if found else None


class TokenStaleness:
    """Counts and applies per-token staleness for one file read at trainer version ``version``
    (an :class:`~treelit.builders.assemble.Assembler` branch hook)."""

    def __init__(self, max_staleness: Optional[int], policy: str, version: int) -> None:
        self.max_staleness, self.policy, self.version = max_staleness, check_policy(policy), int(version)
        self.hist = [0] * (BUCKETS + 1)
        self.dropped_tokens = 0
        self.dropped_branches = 0

    def metrics(self) -> Dict[str, float]:
        out = {f"staleness/tokens_{k}": float(self.hist[k]) for k in range(BUCKETS)}
        out[f"staleness/tokens_{BUCKETS}plus"] = float(self.hist[BUCKETS])
        out["staleness/tokens_dropped"] = float(self.dropped_tokens)
        out["staleness/branches_dropped"] = float(self.dropped_branches)
        return out

    def _stale(self, s: int) -> bool:
        return self.max_staleness is not None and s > self.max_staleness

    def __call__(self, rec: Record, branches: List[Dict[str, Any]]) -> Optional[List[Dict[str, Any]]]:
        """The record's encoded ``branches`` with their stale tokens or branches dropped
        (``drop_tokens``, ``drop_branch``; None: no branch left), counted. A per-token version in
        the future is a :class:`DataError` naming the record and the field."""
        kept = []
        for br, versions in zip(branches, token_versions(branches, _record_version(rec.data))):
            per_token = isinstance(br.get("policy_versions"), list)
            stale_at = []
            for t, v in enumerate(versions):
                if v is None:
                    continue
                if v > self.version and not per_token:
                    v = self.version  # a record-level version ahead: warned about per file, staleness 0
                if v > self.version:
                    wheres = br.get("_version_where")
                    where = wheres[t] if wheres else f"{br.get('_where', 'branch')}.policy_versions[{t}]"
                    raise DataError(f"{rec.source}: {where}: version {v} is newer than the trainer's policy version "
                                    f"{self.version} (a version in the future: the sampler must stamp the version "
                                    "it sampled with, see publish.dir/latest.json)")
                s = self.version - v
                self.hist[min(s, BUCKETS)] += 1
                if self._stale(s):
                    stale_at.append(t)
            if not stale_at or self.policy == "skip_file":
                kept.append(br)
            elif self.policy == "drop_branch":
                self.dropped_branches += 1
                mask = br.get("loss_mask")
                trained = sum(1 for m in mask[1:] if m) if isinstance(mask, list) else len(br["input_ids"]) - 1
                self.dropped_tokens += trained
            else:  # drop_tokens: those tokens leave this branch's loss
                n = len(br["input_ids"])
                mask = br.get("loss_mask")
                mask = [int(bool(m)) for m in mask] if isinstance(mask, list) else [1] * n
                for t in stale_at:
                    mask[t] = 0
                self.dropped_tokens += len(stale_at)
                kept.append(dict(br, loss_mask=mask))
        return kept or None
