"""Per-token staleness: which policy version sampled each token, and what a stale token costs.

A raw branch may carry ``policy_versions``: one entry per token of ``input_ids``, the
version of the weights that sampled it (null for tokens not sampled: the prompt, tool
output). A branch without it takes its record's ``policy_version`` for every trained token
(``loss_mask`` 1; no version at all: version 0). A token's staleness is the trainer's
version minus its own; only trained tokens with a version are counted.

``data.staleness_policy`` says what ``data.max_staleness=S`` does with a token more than S
versions behind:

* ``skip_file`` (default): the whole file is skipped (or refused, ``data.on_stale``), judged
  by its oldest token (:class:`~treelit.lightning.staleness.StalenessGate`).
* ``drop_tokens``: the stale tokens leave the loss (their ``loss_mask`` becomes 0 on that
  branch); the rest of the branch trains. The tree still merges exactly: branches that
  share a token may differ in its mask.
* ``drop_branch``: a branch holding a stale trained token is left out; a record left with no
  branch is left out.

Versions of a shared token that disagree between branches (records may disagree, though a
truly shared prefix was sampled once) are not merged: each branch is judged by its own
versions, so the token leaves the loss of the branches that call it stale and stays in
those that call it fresh, which the tree merges exactly (per-branch masks).

A per-token version newer than the trainer's is a data error naming the record and token (a
version in the future: the sampler and the trainer disagree on what was published); a
record-level ``policy_version`` ahead stays a warning, counted as staleness 0, as before. The reading is done
on the host as each record is read, before any tree is built.

Metrics of each trained file: ``staleness/tokens_0`` .. ``staleness/tokens_3`` and
``staleness/tokens_4plus`` (trained tokens by staleness, before any drop),
``staleness/tokens_dropped`` (trained tokens that left the loss: the stale ones under
``drop_tokens``, every trained token of a dropped branch under ``drop_branch``) and
``staleness/branches_dropped``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from treelit.data.records import DataError, Record

__all__ = ["POLICIES", "BUCKETS", "TokenStaleness", "token_versions"]

POLICIES = ("skip_file", "drop_tokens", "drop_branch")
BUCKETS = 4  # staleness/tokens_0 .. tokens_3, then tokens_4plus


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"data.staleness_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    return policy


def token_versions(data: Dict[str, Any], source: str) -> List[List[Optional[int]]]:
    """Per raw branch of the record ``data``, per token: the version that sampled it, None for a
    token that is not trained-and-versioned (see the module doc). The fields were checked by the
    record validator; a record that is not raw branches gives no versions."""
    branches = data.get("branches") if isinstance(data, dict) else None
    if not isinstance(branches, list):
        return []
    rv = data.get("policy_version")
    rv = rv if isinstance(rv, int) and not isinstance(rv, bool) and rv >= 0 else 0
    out: List[List[Optional[int]]] = []
    for br in branches:
        if not isinstance(br, dict) or not isinstance(br.get("input_ids"), list):
            out.append([])
            continue
        n = len(br["input_ids"])
        mask = br.get("loss_mask")
        trained = [bool(m) for m in mask] if isinstance(mask, list) and len(mask) == n else [True] * n
        trained[0] = False  # position 0 is never a target
        per = br.get("policy_versions")
        if isinstance(per, list) and len(per) == n:
            out.append([v if t else None for v, t in zip(per, trained)])
        else:
            out.append([rv if t else None for t in trained])
    return out


class TokenStaleness:
    """Counts and applies per-token staleness for one file read at trainer version ``version``."""

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

    def __call__(self, rec: Record) -> Optional[Record]:
        """``rec`` with its stale tokens or branches dropped (``drop_tokens``, ``drop_branch``), or
        None when no branch is left; counted. A version in the future is a :class:`DataError`."""
        data = rec.data
        branches = data.get("branches") if isinstance(data, dict) else None
        if not isinstance(branches, list):
            return rec
        kept, changed = [], False
        for j, (br, versions) in enumerate(zip(branches, token_versions(data, rec.source))):
            stale_at = []
            for t, v in enumerate(versions):
                if v is None:
                    continue
                if v > self.version and not isinstance(br.get("policy_versions"), list):
                    v = self.version  # a record-level version ahead: warned about per file, staleness 0
                if v > self.version:
                    where = f"branches[{j}].policy_versions[{t}]"
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
                self.dropped_tokens += sum(1 for m in mask[1:] if m) if isinstance(mask, list) else len(br["input_ids"]) - 1
                changed = True
            else:  # drop_tokens: those tokens leave this branch's loss
                n = len(br["input_ids"])
                mask = br.get("loss_mask")
                mask = [int(bool(m)) for m in mask] if isinstance(mask, list) else [1] * n
                for t in stale_at:
                    mask[t] = 0
                self.dropped_tokens += len(stale_at)
                kept.append(dict(br, loss_mask=mask))
                changed = True
        if not changed:
            return rec
        if not kept:
            return None
        return Record(dict(data, branches=kept), rec.source, rec.position, rec.next, rec.path)
