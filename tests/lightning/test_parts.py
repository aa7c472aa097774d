"""The step as parts (docs/design.md, "The step as parts"): an executor chosen once from the
configuration runs a list of step parts; a new capability is a new part, with no change in the
executors or the module, and the module's step names no feature."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch

import treelit
from helpers import tiny_model
from treelit.lightning import executors
from treelit.lightning.executors import (ContextParallel, CPPartitioned, Partitioned, StepSpec, WholeRow,
                                         choose_executor)
from treelit.lightning.module import TreeLitModule
from treelit.lightning.parts import RouterLoss, StepPart, ValueHead
from treelit.models.critic import Critic
from treelit.objectives import make_objective
from treelit.objectives.folding import target_selection
from treelit.partition.parts import PassPart
from treelit.loss.tree import prepare_batch, tree_hidden
from treelit.models.forward import in_forward, output_weight

BRANCHES = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9, 10, 4, 5, 6], [1, 8, 9]]
MASKS = [[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1], [0, 1, 1]]


class _CP(StepSpec):
    """A spec whose context-parallel degree is given (the choice only reads the degree)."""

    degree = 2

    @property
    def cp_degree(self) -> int:
        return self.degree


def _spec(cls=StepSpec, mode="tree"):
    return cls(torch.nn.Linear(1, 1), None, mode=mode)


def test_the_executor_is_chosen_from_the_configuration_and_the_parts():
    router, critic = RouterLoss.__new__(RouterLoss), ValueHead.__new__(ValueHead)
    assert type(choose_executor(_spec(), [], "none")) is WholeRow
    assert type(choose_executor(_spec(), [critic], "redundancy_free")) is Partitioned
    assert type(choose_executor(_spec(mode="linear"), [critic], "redundancy_free")) is WholeRow
    assert type(choose_executor(_spec(_CP), [router], "none")) is ContextParallel
    # a part one context-parallel pass per row cannot fold (the critic) runs through the partition engine
    cpp = choose_executor(_spec(_CP), [router, critic], "none")
    assert type(cpp) is CPPartitioned and not cpp.partitioned
    cpp = choose_executor(_spec(_CP), [router], "redundancy_free")
    assert type(cpp) is CPPartitioned and cpp.partitioned


def test_the_module_step_names_no_feature():
    """``_training_step``, ``_update``, ``compute_gradients`` and ``_accumulate`` call parts and the
    executor only: no critic, router, routing replay, image or context-parallel condition."""
    words = ("critic", "router", "routing", "replay", "image", "vision", "cp_group", "_cp_degree", "moe")
    for name in ("_training_step", "_update", "compute_gradients", "_accumulate"):
        tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(TreeLitModule, name))))
        code = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        code |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        code |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        found = [w for w in words for c in code if w in c.lower()]
        assert not found, (name, found)
    assert "critic" not in inspect.getsource(executors).replace("objectives.critic", "")


class _HiddenPenalty(StepPart):
    """A capability no executor knows: ``c x`` the sum of the target tokens' hidden states,
    divided by the step normaliser, folded per pass (the partition engine) or added to the
    whole-row loss. Written as a part only; the executors and the module are unchanged."""

    name = "hidden_penalty"
    adds = ("a penalty on the hidden states",)
    needs = ("hidden states of the target rows",)

    def __init__(self, c: float) -> None:
        self.c = c

    def whole_row(self, spec, inner, norms):
        def loss(mb, mode, **kw):
            value, metrics = inner(mb, mode, **kw)
            batch = prepare_batch(spec.model, mb)
            rows = batch.parent[target_selection(batch)]
            h = in_forward(spec.model, lambda m: tree_hidden(m, batch, spec.attention)[0][rows])
            return value + self.c * h.sum() / norms.Z, metrics

        return loss

    def pass_parts(self, norms):
        return [_PenaltyPass(self.c)]


class _PenaltyPass(PassPart):
    reads_targets = True

    def __init__(self, c: float) -> None:
        self.c = c
        self.total = 0.0

    def on_targets(self, run, hs, tok):
        term = self.c * hs.sum() / run.Z
        self.total += float(term.detach())
        return term

    def value(self) -> float:
        return self.total


def _gradients(module, batch):
    module.model.zero_grad(set_to_none=True)
    out = module.compute_gradients([batch])
    return out["loss"], {n: p.grad.clone() for n, p in module.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("objective", ["sft", "grpo"])
def test_a_new_part_composes_with_the_whole_row_and_the_partitioned_executor(objective):
    """The same part, added to the module's list, gives the whole-row executor and the
    partitioned one (a row cut into several passes) the same loss and gradients, and changes
    both (the part is really folded in)."""
    model = tiny_model("qwen2_tiny", torch.float64, seed=3)
    obj = make_objective(objective)
    adv = [1.0, -0.5, 2.0, -1.0] if objective != "sft" else None
    results = {}
    for partition, with_part in (("none", False), ("none", True), ("redundancy_free", True)):
        module = TreeLitModule(model, obj, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), partition=partition,
                               budget_tokens=8, old_logprobs="rollout" if adv else "data")
        if with_part:
            module.parts.append(_HiddenPenalty(0.01))
        batch = treelit.TokenTree.from_branches(BRANCHES, MASKS, advantages=adv).to_batch()
        if adv:
            module.record_rollout_logprobs([batch])
        results[partition, with_part] = _gradients(module, batch)
        if partition != "none":
            assert type(module.executor) is Partitioned and module.last_partition_stats.partitions > 1
    (l0, g0), (l1, g1), (l2, g2) = results[("none", False)], results[("none", True)], results[("redundancy_free", True)]
    assert abs(l1 - l0) > 1e-6
    assert abs(l2 - l1) <= 1e-10 * max(1.0, abs(l1))
    assert g1.keys() == g2.keys()
    for n in g1:
        assert torch.allclose(g1[n], g2[n], rtol=1e-9, atol=1e-12), n
    assert any(not torch.allclose(g0[n], g1[n]) for n in g1)


def test_a_critic_is_a_part_of_the_module():
    model = tiny_model("qwen2_tiny", torch.float64)
    critic = Critic("shared", output_weight(model).shape[1], dtype=torch.float64)
    module = TreeLitModule(model, make_objective("ppo"), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                           critic=critic)
    assert [type(p) for p in module.parts if isinstance(p, ValueHead)] == [ValueHead]
    assert module._clip_groups()[0][0] == "policy"
