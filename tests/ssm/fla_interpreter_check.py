"""``ssm=fla`` through fla's real Triton kernels (Triton's interpreter, CPU) against ``ssm=torch``: loss
and every parameter gradient, unpartitioned and partitioned. Run as its own process (the
interpreter must be chosen before fla is imported; tests/ssm/test_fla_interpreter.py does):

    python tests/ssm/fla_interpreter_check.py gdn_tiny [--mutate] [--cp C]

prints one JSON line per run: ``{"case", "budget", "loss_rel_diff", "max_rel_grad_diff"}``.
``--mutate`` hands one segment a zero initial state instead of its parent's final state in the fla
path, ``--mutate-padding`` leaves dt of mamba-ssm's padded slots non-zero: routing defects the
comparison must catch. ``--cp C``: the fla run split over C gloo processes (context parallelism,
the unpartitioned row only).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton_interpreter  # noqa: E402  (before fla and Triton kernels are imported)

triton_interpreter.install()

import torch  # noqa: E402

import treelit  # noqa: E402
from treelit.ssm import fla_backend, set_ssm_backend  # noqa: E402

# a one-token segment ([15]), a branch that is a prefix of another, and segments of 3 and 4 tokens on one
# level (mamba-ssm runs them as one batch with the shorter one padded)
BRANCHES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 5, 6, 13, 14], [1, 2, 3, 4, 5, 6, 7, 8, 15],
            [1, 2, 16, 21, 22], [1, 2, 16, 21, 22, 17, 18, 19, 20], [1, 2, 16, 21, 22, 23, 24]]
MASKS = [[0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 8, [0] * 6 + [1] * 3, [1] * 5, [0, 1, 0, 1, 1, 1, 1, 1, 1],
         [1] * 7]


def model_for(case: str):
    torch.manual_seed(0)
    if case in ("gdn_tiny", "mamba2_tiny"):
        return treelit.build_model(case, vocab_size=64)
    from hf_oracle import random_hf_checkpoint
    from models.test_hf_hybrid import HYBRID

    model_type, cfg = HYBRID[case]
    path = tempfile.mkdtemp()
    random_hf_checkpoint(path, model_type, **dict(cfg, vocab_size=64))
    return treelit.load_hf_model(path, dtype=torch.float32)


def run(model, backend: str, tree, budget):
    with mock.patch.object(torch.cuda, "is_available", lambda: True):
        set_ssm_backend(model, backend)
    model.zero_grad(set_to_none=True)
    if budget is None:
        loss = treelit.tree_loss(model, tree)
        loss.backward()
        loss = loss.item()
    else:
        loss = treelit.tree_backward(model, tree, budget_tokens=budget)
    return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def mutate() -> None:
    """The fla path's level scan gives the first child segment a zero state (its parent's is dropped)."""
    original = fla_backend.level_scan

    def level_scan(kernel, inputs, layout, state_shape, init_state, dtype=torch.float32):
        children = [i for i, p in enumerate(layout.seg_parent) if p >= 0]
        if children:
            layout.seg_parent = layout.seg_parent.copy()
            layout.seg_parent[children[0]] = -1
        return original(kernel, inputs, layout, state_shape, init_state, dtype)

    fla_backend.level_scan = level_scan


def mutate_padding() -> None:
    """mamba-ssm's padded slots keep their dt (the state runs on past the segment's end)."""
    fla_backend._padded_dt = lambda dt, valid: dt


def _cp_worker(rank: int, C: int, port: int, case: str, out: str, mutated: bool) -> None:
    """One rank of context parallelism with ``ssm=fla``: its range's scans start from the states
    the earlier ranks send (several initial states per range), run through fla's kernels."""
    import torch.distributed as dist

    from treelit.objectives import make_objective
    from treelit.partition.context_parallel import cp_micro_batch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    model = model_for(case)  # (before the group: transformers writes a checkpoint on the first rank only)
    dist.init_process_group("gloo", rank=rank, world_size=C)
    if mutated:
        mutate()
    calls = []
    scan = fla_backend.level_scan
    fla_backend.level_scan = lambda *a, **k: calls.append(1) or scan(*a, **k)
    try:
        with mock.patch.object(torch.cuda, "is_available", lambda: True):
            set_ssm_backend(model, "fla")
        batch = treelit.TokenTree.from_branches(BRANCHES, MASKS).to_batch()
        obj = make_objective("sft")
        value, _, _ = cp_micro_batch(model, obj, batch, None, aggregation="token-mean",
                                     normalizer=obj.norm_contribution(batch, "token-mean"), attention="sdpa_dense")
        grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
        for g in grads.values():
            dist.all_reduce(g)
        assert calls, "fla's level scan did not run"
        if rank == 0:
            torch.save({"value": value, "grads": grads}, out)
    finally:
        dist.destroy_process_group()


def main_cp(case: str, C: int, mutated: bool) -> None:
    """``ssm=fla`` split over C gloo processes against ``ssm=torch`` on one process."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(), "cp.pt")
    mp.spawn(_cp_worker, args=(C, port, case, out, mutated), nprocs=C, join=True)
    got = torch.load(out, weights_only=True)
    model = model_for(case)
    ref, g_ref = run(model, "torch", treelit.TokenTree.from_branches(BRANCHES, MASKS), None)
    assert ref != 0
    worst = max(((got["grads"][n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in g_ref.items())
    print(json.dumps({"case": case, "cp": C, "budget": None, "loss_rel_diff": abs(got["value"] - ref) / abs(ref),
                      "max_rel_grad_diff": worst, "min_grad_norm": min(g.norm().item() for g in g_ref.values())}),
          flush=True)


def main() -> None:
    case = sys.argv[1]
    if "--cp" in sys.argv:
        return main_cp(case, int(sys.argv[sys.argv.index("--cp") + 1]), "--mutate" in sys.argv)
    if "--mutate" in sys.argv:
        mutate()
    if "--mutate-padding" in sys.argv:
        mutate_padding()
    model = model_for(case)
    tree = treelit.TokenTree.from_branches(BRANCHES, MASKS)
    for budget in (None, 12):  # (12: the longest branch; the tree is cut into partitions)
        (ref, g_ref), (got, g_fla) = run(model, "torch", tree, budget), run(model, "fla", tree, budget)
        assert g_ref.keys() == g_fla.keys() and ref != 0
        worst = max(((g_fla[n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in g_ref.items())
        print(json.dumps({"case": case, "budget": budget, "loss_rel_diff": abs(got - ref) / abs(ref),
                          "max_rel_grad_diff": worst, "min_grad_norm": min(g.norm().item() for g in g_ref.values())}),
              flush=True)


if __name__ == "__main__":
    main()
