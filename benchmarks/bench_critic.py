"""PPO with a critic (a value head on the policy's trunk), tree vs per-branch: step time and peak memory.

One PPO update with a shared critic, as ``critic=shared`` runs it: the values of the step's
states (a pass without gradients), GAE over every (branch, action token) pair, the advantages
whitened over the step, then the policy loss plus ``vf_coef`` x the clipped value loss, forward
and backward. Three paths, in one process, on the same weights:

* ``tree``: treelit's tree step (:func:`~treelit.objectives.critic.tree_values`, GAE on the tree,
  :func:`~treelit.objectives.critic.critic_tree_loss`): every shared token and its value once;
* ``linear``: treelit's own per-branch path (``mode=linear``): each branch its own causal
  sequence, in padded micro-batches;
* ``hf``: the loop users run today, written here without treelit: the same weights in
  ``transformers`` with a value head on its last hidden state, branch by branch in padded
  micro-batches, GAE from its definition in numpy, PPO's clipped surrogate and clipped value
  loss in torch.

The model is bench_models' ``realistic`` shape (qwen2-style, its vocabulary head 0.42x the trunk
per trained token, as in Qwen2.5-0.5B). The case is real: tau-bench airline task 0, the first
model call of each of its 4 trials, each call trained on its own output; branch ``b``'s reward is
``b mod 2`` at its last token. Old log-probs are the current ones (the first update of a PPO
step), so the ratio is 1 and the work is any update's.

Time: this process's CPU time on one thread, the median of ``--reps`` updates per path (odd
repetitions in reverse order). Memory: the peak of the tensors an update allocates (followed on
CPU by :mod:`treelit.utils.memory`), gradients included, parameters excluded. ``grad_diff``: the
largest relative difference of any parameter gradient (policy and value head) from the tree
step's (float32).

    python benchmarks/bench_critic.py --json benchmarks/results/bench_critic.json
    python benchmarks/bench_critic.py --quick           # a tiny model and case, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import treelit  # noqa: E402
from bench_models import PRESETS, attention_model, cost_model  # noqa: E402
from bench_step import BASE_LINEAR_TOKENS, load_case  # noqa: E402
from hf_peer import padded_micro_batches  # noqa: E402
from treelit.models.critic import Critic  # noqa: E402
from treelit.models.hf import tune_to_hf_state_dict  # noqa: E402
from treelit.objectives import make_objective  # noqa: E402
from treelit.objectives.critic import (branch_values, critic_linear_loss, critic_tree_loss, prepare_branches,  # noqa: E402
                                       prepare_tree, set_branch_advantages, set_tree_advantages, tree_values)
from treelit.rl.gae import whiten  # noqa: E402
from treelit.utils.memory import LiveBytes  # noqa: E402

MIB = 2**20
QUICK_PRESET = dict(dim=64, layers=2, heads=4, kv_heads=2, intermediate=192, vocab=2048)
PATHS = ("tree", "linear", "hf")


def totals(advs: List[np.ndarray]):
    flat = np.concatenate([a[~np.isnan(a)] for a in advs])
    return len(flat), flat.sum(), (flat * flat).sum()


def hf_gae(values: np.ndarray, actions: np.ndarray, reward: float, gamma: float, lam: float):
    """GAE of one branch from its definition: ``delta_t = r_t + gamma V_next - V_t``,
    ``A_t = delta_t + gamma lam A_next`` over the action tokens; the reward at the last one."""
    idx = np.flatnonzero(actions)
    adv, ret = np.zeros(len(idx)), np.zeros(len(idx))
    nxt_v = nxt_a = 0.0
    for j in range(len(idx) - 1, -1, -1):
        r = reward if j == len(idx) - 1 else 0.0
        v = values[idx[j]]
        delta = r + gamma * nxt_v - v
        a = delta + gamma * lam * nxt_a
        adv[j], ret[j] = a, a + v
        nxt_v, nxt_a = v, a
    return idx, adv, ret


class HFLoop:
    """PPO + value head in plain ``transformers``, branch by branch (no treelit code)."""

    def __init__(self, hf, head: torch.nn.Linear, args):
        self.hf, self.head, self.args = hf, head, args

    def _batch(self, branches, group):
        L = max(len(branches[i]) for i in group)
        ids = torch.zeros(len(group), L, dtype=torch.long)
        attn = torch.zeros(len(group), L, dtype=torch.long)
        for r, i in enumerate(group):
            ids[r, : len(branches[i])] = torch.tensor(branches[i])
            attn[r, : len(branches[i])] = 1
        return ids, attn

    def step(self, branches, masks, rewards) -> float:
        a, micro = self.args, self.args.micro
        groups = padded_micro_batches([len(b) for b in branches], micro)
        values = [None] * len(branches)
        with torch.no_grad():  # the rollout's values
            for group in groups:
                ids, attn = self._batch(branches, group)
                h = self.hf.model(input_ids=ids, attention_mask=attn).last_hidden_state
                v = self.head(h)[..., 0]
                for r, i in enumerate(group):
                    values[i] = np.concatenate([[np.nan], v[r, : len(branches[i]) - 1].double().numpy()])
        gae = []
        for i, b in enumerate(branches):
            act = np.array([bool(m) and t > 0 for t, m in enumerate(masks[i])])
            gae.append(hf_gae(values[i], act, rewards[i], a.gamma, a.lam))
        flat = np.concatenate([adv for _, adv, _ in gae])
        mean, std = flat.mean(), flat.std() + 1e-8
        Z = float(len(flat))
        total = 0.0
        for group in groups:
            ids, attn = self._batch(branches, group)
            h = self.hf.model(input_ids=ids, attention_mask=attn).last_hidden_state
            loss = None
            for r, i in enumerate(group):
                idx, adv, ret = gae[i]
                if not len(idx):
                    continue
                t = torch.from_numpy(idx)
                hs = h[r, t - 1]  # the state before each action token
                lp = torch.log_softmax(self.hf.lm_head(hs).float(), -1).gather(1, ids[r, t][:, None])[:, 0]
                ratio = torch.exp(lp - lp.detach())
                A = torch.from_numpy((adv - mean) / std).to(lp.dtype)
                pg = -torch.minimum(ratio * A, ratio.clamp(1 - a.clip, 1 + a.clip) * A)
                v = self.head(hs)[:, 0]
                old = torch.from_numpy(values[i][idx]).to(v.dtype)
                R = torch.from_numpy(ret).to(v.dtype)
                vc = old + (v - old).clamp(-a.value_clip, a.value_clip)
                vl = 0.5 * torch.maximum((v - R) ** 2, (vc - R) ** 2)
                term = (pg + a.vf_coef * vl).sum() / Z
                loss = term if loss is None else loss + term
            if loss is not None:
                loss.backward()
                total += float(loss.detach())
        return total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write results here")
    p.add_argument("--quick", action="store_true", help="a tiny model on a small synthetic case, one repetition")
    p.add_argument("--case", default=None, help="tau_bench (default) or one of bench_step's synthetic attention cases")
    p.add_argument("--tau-calls", type=int, default=1, help="tau_bench: first model calls kept per trial")
    p.add_argument("--scale", type=float, default=None, help="size of a synthetic case (default 0.1; quick 0.02)")
    p.add_argument("--mask", choices=["all", "assistant"], default="all", help="loss mask of a synthetic case")
    p.add_argument("--preset", default="realistic", choices=sorted(PRESETS), help="model shape (see bench_models)")
    p.add_argument("--reps", type=int, default=None, help="timed updates per path (default 3; quick 1)")
    p.add_argument("--linear-tokens", type=int, default=None, help="padded tokens per per-branch micro-batch (8192)")
    p.add_argument("--gamma", type=float, default=1.0)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--no-peer", dest="peer", action="store_false", help="skip the transformers loop")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.case = args.case or ("multi_turn" if args.quick else "tau_bench")
    if args.case.startswith("hybrid/"):
        p.error("--case: attention cases only (the transformers loop runs qwen2)")
    args.scale = args.scale if args.scale is not None else (0.02 if args.quick else 0.1)
    args.reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    args.clip, args.value_clip, args.vf_coef = 0.2, 0.5, 0.5
    c = QUICK_PRESET if args.quick else PRESETS[args.preset]
    args.model_cfg, args.hybrid_scale = dict(c), 1.0
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    model = attention_model(**c)
    cost = cost_model(model)
    critic = Critic("shared", c["dim"], vf_coef=args.vf_coef, value_clip=args.value_clip)
    case, _ = load_case(args.case, args, c["vocab"])
    branches, masks = case.branches, case.masks
    rewards = [float(b % 2) for b in range(len(branches))]
    tree = treelit.TokenTree.from_branches(branches, masks, branch_fields={"reward": rewards})
    stats = tree.stats()
    args.micro = args.linear_tokens or (BASE_LINEAR_TOKENS if args.case == "tau_bench"
                                        else max(256, round(BASE_LINEAR_TOKENS * args.scale)))
    objective = make_objective("ppo", clip_low=args.clip, gamma=args.gamma, lam=args.lam)
    n_params = sum(p.numel() for p in model.parameters())
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "timer": "cpu",
           "cpu": platform.processor() or platform.machine(),
           "model": (f"{'quick' if args.quick else args.preset}: qwen2-style, {c['layers']} layers, dim {c['dim']}, "
                     f"{c['heads']} heads ({c['kv_heads']} kv), MLP {c['intermediate']}, vocab {c['vocab']}, float32, "
                     f"{n_params / 1e6:.1f}M parameters; head/trunk per token {cost['head_over_trunk']:.2f}; a "
                     f"shared value head (vf_coef {args.vf_coef}, value_clip {args.value_clip}), gamma {args.gamma}, "
                     f"lam {args.lam}"),
           "case": case.name, "linear_tokens": args.micro, "reps": args.reps,
           "load_before": os.getloadavg()[0], "command": " ".join([os.path.basename(sys.executable), *sys.argv])}
    print(f"# {env['model']}; torch {env['torch']}, {env['threads']} thread, CPU time; load {env['load_before']:.1f}")
    print(f"# case {case.name}: {stats['flat_tokens']} flat tokens, {stats['tree_tokens']} tree tokens "
          f"({stats['branches']} branches); per-branch micro-batches of {args.micro} padded tokens", flush=True)

    params = list(model.parameters()) + list(critic.parameters())

    def tree_step() -> float:
        batch = tree.to_batch()
        with torch.no_grad():
            pairs = prepare_tree(batch, tree_values(critic, model, batch), args.gamma, args.lam)
        act = pairs.adv[pairs.action]
        (adv,) = whiten([pairs.adv], (len(act), act.sum(), (act * act).sum()))
        set_tree_advantages(batch, pairs, adv)
        loss, _ = critic_tree_loss(objective, critic, model, batch, aggregation="token-mean",
                                   normalizer=float(batch.num_targets))
        loss.backward()
        return float(loss.detach())

    def linear_step() -> float:
        br = treelit.Branches.build(branches, masks, branch_fields={"reward": rewards})
        vals = branch_values(critic, model, br, max_tokens=args.micro)
        gae = prepare_branches(br, vals, args.gamma, args.lam)
        advs = [a for a, _ in gae]
        set_branch_advantages(br, gae, whiten(advs, totals(advs)), vals)
        loss, _ = critic_linear_loss(objective, critic, model, br, aggregation="token-mean",
                                     normalizer=float(sum(br.n)), max_tokens=args.micro)
        loss.backward()
        return float(loss.detach())

    steps: Dict[str, Callable[[], float]] = {"tree": tree_step, "linear": linear_step}
    owners = {"tree": params, "linear": params}
    peer = None
    if args.peer:
        import transformers

        with tempfile.TemporaryDirectory(prefix="bench_critic_") as tmp:
            treelit.save_hf_checkpoint(model, Path(tmp))
            hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32,
                                                                   attn_implementation="sdpa")
        hf.train()
        head = torch.nn.Linear(c["dim"], 1)
        head.load_state_dict(critic.head.state_dict())
        peer = HFLoop(hf, head, args)
        steps["hf"] = lambda: peer.step(branches, masks, rewards)
        owners["hf"] = list(hf.parameters()) + list(head.parameters())

    def grads_of(path: str) -> Dict[str, torch.Tensor]:
        if path == "hf":
            g = {n: q.grad.clone() for n, q in peer.hf.named_parameters() if q.grad is not None}
            g.update({f"value_head.{n}": q.grad.clone() for n, q in peer.head.named_parameters()})
            return g
        g = tune_to_hf_state_dict({n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None},
                                  model.config)
        if model.config.tie_word_embeddings:
            g.pop("lm_head.weight", None)
        g.update({f"value_head.{n}": q.grad.clone() for n, q in critic.head.named_parameters()})
        return g

    rows, grads = {}, {}
    for path in steps:  # the first update of each path: warm-up, memory, gradients
        for q in owners[path]:
            q.grad = None
        with LiveBytes() as live:
            loss = steps[path]()
        grads[path] = grads_of(path)
        rows[path] = {"path": path, "peak_bytes": live.peak, "loss": loss}
        print(f"  {path}: peak {live.peak / MIB:.0f} MiB, loss {loss:.6f}", flush=True)
    times: Dict[str, List[float]] = {k: [] for k in steps}
    order = list(steps)
    for rep in range(args.reps):
        for path in (order if rep % 2 == 0 else order[::-1]):
            for q in owners[path]:
                q.grad = None
            t0 = time.process_time()
            steps[path]()
            times[path].append(time.process_time() - t0)
    base = rows["tree"]
    for path, r in rows.items():
        r["time_s"] = statistics.median(times[path])
        r["times_s"] = times[path]
    for path, r in rows.items():
        r["time_vs_tree"] = r["time_s"] / base["time_s"]
        r["peak_vs_tree"] = r["peak_bytes"] / base["peak_bytes"]
        if path != "tree":
            a, b = grads[path], grads["tree"]
            if a.keys() != b.keys():
                raise RuntimeError(f"{path}: gradients of different parameters: {sorted(set(a) ^ set(b))[:4]}")
            r["max_rel_grad_diff"] = max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)).item() for k in b)
            r["loss_rel_diff"] = abs(r["loss"] - base["loss"]) / max(abs(base["loss"]), 1e-30)
    head = f"{'path':<8}{'update':>9}{'/tree':>8}{'peak':>10}{'/tree':>8}{'grad_diff':>11}{'loss_diff':>11}"
    print(head)
    print("-" * len(head))
    for path, r in rows.items():
        print(f"{path:<8}{r['time_s']:>8.2f}s{r['time_vs_tree']:>7.2f}x{r['peak_bytes'] / MIB:>9.0f}M"
              f"{r['peak_vs_tree']:>7.2f}x{format(r.get('max_rel_grad_diff'), '.1e') if path != 'tree' else '-':>11}"
              f"{format(r.get('loss_rel_diff'), '.1e') if path != 'tree' else '-':>11}")
    env["load_after"] = os.getloadavg()[0]
    print(f"# load average {env['load_before']:.1f} before, {env['load_after']:.1f} after")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"env": env, "case": stats, "rows": list(rows.values())}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
