"""``treelit-rollout --partial``: partial rollouts, where unfinished generations continue under
each newly published version instead of restarting.

The sampler keeps ``--prompts-per-step`` x ``--n`` completion slots busy (a group is ``--n``
completions of one prompt) and decodes one token for every unfinished completion of every group
in flight in one batched forward. When ``latest.json`` names a newer version, decoding pauses
between two tokens, the new weights are loaded, and every unfinished completion continues under
them. A group whose completions have all finished (EOS or ``--max-new-tokens``) is done; as soon
as ``--n`` slots are free (completions that ended, of any group) the next prompt's group starts;
file ``i`` is written when ``--prompts-per-step`` groups are done (in the order they finished),
so a long generation does not hold back the short ones: it lands in a later file. Each branch
records the version that sampled each token, ``"policy_versions"`` (null for the prompt; the
field the trainer reads per token, see :mod:`treelit.lightning.token_staleness`), and its
``old_logprobs`` are those of that version. The record's ``policy_version`` is its oldest
sampled token's. A branch whose head was sampled under version v and tail under v+1 merges into
the tree like any other branch.

Staleness: no token is sampled for file ``i`` or later before the published version reaches
``(i - --max-staleness) x --versions-per-step`` (the same bound as without ``--partial``); a
generation that spans several files keeps the tokens of the versions it started under, so its
head may be more versions behind than ``--max-staleness`` when it is trained: the trainer's
``data.staleness_policy`` decides (``drop_tokens`` trains the rest of the branch; ``skip_file``
skips the whole file). Routing is not recorded with ``--partial``.

Each token step recomputes the prefixes of all completions in flight (no KV cache; sequences of
close lengths share a right-padded forward, :func:`length_buckets`): a reference sampler for
small models, like ``--engine treelit``. The per-file JSON line on stdout adds ``versions`` (the
oldest and newest token version in the file), ``switches`` (versions loaded while generations
were unfinished), ``carried`` (groups left in flight for later files), ``tokens`` and
``forwards`` (tokens sampled and token steps, each one batched decode over the completions in
flight, since the previous file); ``wait_s`` is the time the sampler sat idle waiting for a
version.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = ["Group", "forward_last", "length_buckets", "Pool", "run_partial", "write_file"]


class Group:
    """``n`` completions of one prompt, sampled token by token, each token stamped with its version."""

    def __init__(self, key: str, prompt: List[int], fields: Dict[str, Any], n: int, serial: int) -> None:
        self.key, self.prompt, self.fields, self.serial = key, list(prompt), fields, serial
        self.tokens: List[List[int]] = [[] for _ in range(n)]
        self.logprobs: List[List[float]] = [[] for _ in range(n)]
        self.versions: List[List[int]] = [[] for _ in range(n)]
        self.done = [False] * n

    @property
    def finished(self) -> bool:
        return all(self.done)

    def branches(self, reward) -> List[Dict[str, Any]]:
        P, out = len(self.prompt), []
        for toks, lps, vs in zip(self.tokens, self.logprobs, self.versions):
            r = float(reward(prompt_ids=list(self.prompt), completion_ids=list(toks), **self.fields))
            out.append({"input_ids": self.prompt + toks, "loss_mask": [0] * P + [1] * len(toks),
                        "old_logprobs": [None] * P + lps, "policy_versions": [None] * P + vs, "reward": r,
                        "group": self.key})
        return out


FORWARD_COST = 256  # a forward's fixed cost, in token positions (small models on CPU: ~4.5 ms, ~0.02 ms a position)


def length_buckets(lens: List[int], fixed: int = FORWARD_COST) -> List[List[int]]:
    """The rows (indices into ``lens``) of each forward: sequences sorted by length and cut
    into runs that minimise ``sum(fixed + rows x longest)`` (padding against forwards)."""
    order = sorted(range(len(lens)), key=lambda j: -lens[j])
    n = len(order)
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for e in range(1, n + 1):  # best[e]: the first e sorted rows; a run [b, e) is padded to lens[order[b]]
        for b in range(e):
            c = best[b] + fixed + (e - b) * lens[order[b]]
            if c < best[e]:
                best[e], cut[e] = c, b
    runs, e = [], n
    while e:
        runs.append(order[cut[e]:e])
        e = cut[e]
    return runs[::-1]


def forward_last(sampler, seqs: List[List[int]]):
    """Next-token logits ``[len(seqs), vocab]`` of the sampler's model after each sequence:
    sequences of close lengths share a right-padded forward (causal: the padding after a
    sequence never reaches its positions), read at each sequence's last token."""
    import torch  # cli: treelit-rollout --help pays for no torch

    out = None
    with torch.no_grad():
        for rows in length_buckets([len(s) for s in seqs]):
            lens = torch.tensor([len(seqs[j]) for j in rows])
            L = int(lens.max())
            ids = torch.tensor([seqs[j] + [seqs[j][-1]] * (L - len(seqs[j])) for j in rows])
            at = torch.arange(len(rows))
            if sampler.native:
                from treelit.models.context import CausalContext
                from treelit.models.decoder import decoder_hidden, output_weight

                pos = torch.arange(L)[None].expand(len(rows), -1)
                h = decoder_hidden(sampler.model, ids, pos, CausalContext())[at, lens - 1]
                logits = h @ output_weight(sampler.model).t()
            else:
                logits = sampler.model(input_ids=ids, use_cache=False).logits[at, lens - 1]
            if out is None:
                out = logits.new_empty(len(seqs), logits.shape[-1])
            out[torch.tensor(rows)] = logits
    return out


class Pool:
    """The groups in flight and the groups done; :meth:`step` samples one token for each
    unfinished completion under the sampler's current version. ``stop_at(group, row)``: an
    optional length (in tokens) at which a completion ends (benchmarks shape the length
    distribution with it); EOS and ``max_new_tokens`` end one always."""

    def __init__(self, sampler, n: int, max_new_tokens: int, generator,
                 stop_at: Optional[Callable[[Group, int], int]] = None) -> None:
        self.sampler, self.n, self.max_new, self.gen, self.stop_at = sampler, n, max_new_tokens, generator, stop_at
        self.flight: List[Group] = []
        self.done: List[Group] = []
        self.serial = 0
        self.row_steps = 0  # tokens sampled (completions decoded, summed over forwards)
        self.forwards = 0

    def add(self, key: str, prompt: List[int], fields: Dict[str, Any]) -> None:
        self.flight.append(Group(key, prompt, fields, self.n, self.serial))
        self.serial += 1

    def step(self) -> None:
        import torch  # cli: treelit-rollout --help pays for no torch

        live = [(g, r) for g in self.flight for r in range(self.n) if not g.done[r]]
        if not live:
            return
        logits = forward_last(self.sampler, [g.prompt + g.tokens[r] for g, r in live])
        logp = torch.log_softmax(logits.double(), -1)
        nxt = torch.multinomial(logp.exp(), 1, generator=self.gen)
        lps = logp.gather(1, nxt)[:, 0].tolist()
        version, eos = int(self.sampler.version), self.sampler.eos
        self.row_steps += len(live)
        self.forwards += 1
        for (g, r), t, lp in zip(live, nxt[:, 0].tolist(), lps):
            g.tokens[r].append(t)
            g.logprobs[r].append(lp)
            g.versions[r].append(version)
            cap = self.max_new if self.stop_at is None else min(self.max_new, max(1, self.stop_at(g, r)))
            if (eos is not None and t == eos) or len(g.tokens[r]) >= cap:
                g.done[r] = True
        for g in [g for g in self.flight if g.finished]:
            self.flight.remove(g)
            self.done.append(g)

    def unfinished(self) -> int:
        return sum(1 for g in self.flight for d in g.done if not d)


def write_file(out: Path, i: int, groups: List[Group], reward) -> Tuple[List[float], List[int]]:
    """``out/step-<i>.jsonl`` (under a temporary name, then renamed), one record per group;
    returns the rewards and the token versions written."""
    records, rewards, versions = [], [], []
    for g in groups:
        branches = g.branches(reward)
        rewards += [b["reward"] for b in branches]
        vs = [v for row in g.versions for v in row]
        versions += vs
        records.append({"id": g.key, "policy_version": min(vs), "branches": branches})
    name = f"step-{i:06d}.jsonl"
    tmp = out / f".{name}.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, out / name)
    return rewards, versions


def run_partial(a, start: int, sampler_cls: Callable, read_prompts: Callable,
                stop_at: Optional[Callable[[Group, int], int]] = None,
                log: Optional[Callable[[Dict[str, Any]], None]] = None) -> int:
    """Files ``start`` .. ``a.steps - 1`` of ``treelit-rollout --partial`` (``a``: its parsed
    arguments; ``sampler_cls`` and ``read_prompts``: :mod:`treelit.cli.rollout`'s sampler and
    prompt reader, handed in so that the two modules do not import each other); ``log``
    receives each file's stats (default: printed as a JSON line)."""
    import torch  # cli: treelit-rollout --help pays for no torch

    from treelit.rl.rewards import resolve_reward

    if a.record_routing:
        raise ValueError("--record-routing: routing is not recorded with --partial (sample without --partial)")
    out = Path(a.out)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    reward = resolve_reward(a.reward)
    sampler = sampler_cls(a.publish_dir, a.dtype, a.base, a.engine)
    pool = Pool(sampler, a.n, a.max_new_tokens, torch.Generator().manual_seed(a.seed * 1_000_003 + start), stop_at)
    prompts, B, started = None, None, 0
    i = start
    t_file, waited, loading, switches, seen = time.monotonic(), 0.0, 0.0, 0, (0, 0)
    while i < a.steps:
        need = max(0, (i - a.max_staleness) * a.versions_per_step)
        latest = sampler.latest()
        if sampler.version is None or sampler.version < need:
            t0 = time.monotonic()
            while latest is None or int(latest["version"]) < need:  # idle: no token may be sampled yet
                if time.monotonic() - t0 > a.timeout_s:
                    raise TimeoutError(f"{a.publish_dir}: no policy version >= {need} within --timeout-s={a.timeout_s:g}s")
                time.sleep(a.poll_s)
                latest = sampler.latest()
            waited += time.monotonic() - t0
        if latest is not None and (sampler.version is None or int(latest["version"]) > sampler.version):
            if latest.get("moe_routing") == "replay":
                raise ValueError(f"{a.publish_dir}/latest.json: the policy records routing (model.moe.routing=replay), "
                                 "which --partial does not: sample without --partial")
            t0 = time.monotonic()
            switches += pool.unfinished() > 0  # generations pause here and continue under the new weights
            sampler.load(latest)
            loading += time.monotonic() - t0
            if sampler.images is not None:
                raise ValueError(f"{a.publish_dir}: a vision-language policy: --partial continues text generations "
                                 "only (image prompts' pixel inputs are not carried across versions); sample "
                                 "without --partial")
        if prompts is None:
            prompts = read_prompts(a.prompts, sampler.tokenizer_dir)
            B = a.prompts_per_step or len(prompts)
            started = start * B
        while pool.unfinished() + a.n <= B * a.n and started < a.steps * B:  # freed slots take the next prompts
            rec = dict(prompts[started % len(prompts)])
            prompt = rec.pop("input_ids")
            pool.add(f"{rec.get('id')}@{started}", prompt, {k: v for k, v in rec.items() if k != "id"})
            started += 1
        pool.step()
        if len(pool.done) >= B:
            groups, pool.done = pool.done[:B], pool.done[B:]
            rewards, versions = write_file(out, i, groups, reward)
            now = time.monotonic()
            stats = {"step": i, "policy_version": sampler.version, "versions": [min(versions), max(versions)],
                     "reward_mean": sum(rewards) / len(rewards), "wait_s": round(waited, 4), "load_s": round(loading, 4),
                     "sample_s": round(now - t_file - waited - loading, 4), "switches": switches,
                     "carried": len(pool.flight) + len(pool.done), "completions": len(rewards),
                     "tokens": pool.row_steps - seen[0], "forwards": pool.forwards - seen[1]}
            (log or (lambda s: print(json.dumps(s), flush=True)))(stats)
            t_file, waited, loading, switches, seen = now, 0.0, 0.0, 0, (pool.row_steps, pool.forwards)
            i += 1
    return 0
