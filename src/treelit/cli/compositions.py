"""The composition matrix: which features run on which strategies, and why the rest is refused.

One table, read by three things: the option checks (:mod:`treelit.cli.model_option_checks` refuses
what :data:`REFUSALS` lists, one line naming the option), the composition test
(``tests/distributed/test_composition.py`` runs every cell the table allows and holds it against
one unpartitioned process in float64, and expects the one-line refusal for the others) and the
refusal table on docs/distributed.md (:func:`refusal_table`, checked against this module by
``tests/test_docs.py``).

A feature is a capability of the step (:mod:`treelit.lightning.parts`) or of the model; a
strategy is an executor (:mod:`treelit.lightning.executors`) composed with a data-parallel
strategy. A refusal stays only where the math or a dependency forbids the combination, or where
the combination has not been held against a per-branch reference yet; when that work lands, its
row goes and every cell it covered runs in the composition test, with no other edit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterable, List, Optional, Tuple

__all__ = ["FEATURES", "STRATEGIES", "EXCLUSIVE", "Refusal", "REFUSALS", "refusal", "refusals", "exclusive",
           "refusal_table", "MULTI_PROCESS"]

# feature -> what it is, as a user turns it on
FEATURES: Dict[str, str] = {
    "images": "model.vision=true (a vision-language checkpoint with its vision tower, images in the trees)",
    "routing_replay": "model.moe.routing=replay (the experts the sampler recorded)",
    "router_loss": "model.router_aux_loss_coef > 0 (the router load-balancing loss)",
    "shared_critic": "critic=shared (a value head on the policy's trunk)",
    "separate_critic": "critic=separate (the critic's own model)",
    "lora": "model.lora.rank (LoRA adapters on the language model)",
    "hybrid": "Gated DeltaNet / Mamba2 layers beside attention",
    "checkpointing": "model.activation_checkpointing=true",
    "reference_kl": "objective.kl_coef > 0 with objective.reference=initial (a frozen reference model)",
}

# strategy -> its options
STRATEGIES: Dict[str, str] = {
    "one_process": "trainer=cpu",
    "partitioned": "trainer=cpu partition=redundancy_free",
    "ddp": "trainer=ddp_cpu trainer.devices=2",
    "fsdp2": "trainer=fsdp2_cpu trainer.devices=2",
    "hsdp": "trainer=fsdp2_cpu trainer.devices=4 trainer.strategy.replicate_degree=2",
    "cp": "trainer=fsdp2_cpu trainer.devices=2 trainer.strategy.context_parallel_degree=2",
    "cp_partitioned": "trainer=fsdp2_cpu trainer.devices=2 trainer.strategy.context_parallel_degree=2 "
                      "partition=redundancy_free",
    "fsdp2_partitioned": "trainer=fsdp2_cpu trainer.devices=2 partition=redundancy_free",
}
MULTI_PROCESS = ("ddp", "fsdp2", "hsdp", "cp", "cp_partitioned", "fsdp2_partitioned")

# pairs of features that are two values of one option: never together, nothing to refuse
EXCLUSIVE: Tuple[FrozenSet[str], ...] = (frozenset({"shared_critic", "separate_critic"}),)


@dataclass(frozen=True)
class Refusal:
    """A refused combination: ``features`` (one or two) on ``strategies`` (empty: every one),
    on the model path ``model`` (``""``: every one; ``hf_auto``: the transformers adapter),
    refused in one line naming ``option``, for ``reason``."""

    features: Tuple[str, ...]
    strategies: Tuple[str, ...]
    option: str
    reason: str
    model: str = ""

    def covers(self, features: Iterable[str], strategy: str, model: str = "") -> bool:
        feats = set(features)
        return (set(self.features) <= feats and (not self.strategies or strategy in self.strategies)
                and (not self.model or self.model == model))


REFUSALS: Tuple[Refusal, ...] = ()  # (every feature runs on every strategy; a row here refuses a cell)


def refusals(features: Iterable[str], strategy: str, model: str = "") -> List[Refusal]:
    """Every row of :data:`REFUSALS` that covers ``features`` on ``strategy`` and model path ``model``."""
    feats = tuple(features)
    unknown = [f for f in feats if f not in FEATURES] + ([strategy] if strategy not in STRATEGIES else [])
    if unknown:
        raise KeyError(f"not in the composition matrix: {', '.join(unknown)}")
    return [r for r in REFUSALS if r.covers(feats, strategy, model)]


def refusal(features: Iterable[str], strategy: str, model: str = "") -> Optional[Refusal]:
    """The first refusal of ``features`` on ``strategy`` (None: the combination runs)."""
    found = refusals(features, strategy, model)
    return found[0] if found else None


def exclusive(features: Iterable[str]) -> bool:
    """Whether ``features`` holds two values of one option (:data:`EXCLUSIVE`)."""
    feats = set(features)
    return any(pair <= feats for pair in EXCLUSIVE)


def refusal_table() -> str:
    """The refusals as a Markdown table (docs/distributed.md, "What does not combine")."""
    rows = ["| features | strategies | model | refused by | why |", "|---|---|---|---|---|"]
    for r in REFUSALS:
        strategies = ", ".join(r.strategies) if r.strategies else "every strategy"
        rows.append(f"| {' + '.join(r.features)} | {strategies} | {r.model or 'every model'} | `{r.option}` "
                    f"| {r.reason} |")
    for pair in EXCLUSIVE:
        rows.append(f"| {' + '.join(sorted(pair))} | every strategy | every model | (one option) "
                    f"| two values of one option: a run has one critic |")
    return "\n".join(rows)


BEGIN, END = "<!-- COMPOSITIONS_BEGIN -->", "<!-- COMPOSITIONS_END -->"


def docs_section(page: str) -> str:
    """``page`` (docs/distributed.md) with the text between its markers set to :func:`refusal_table`."""
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{refusal_table()}\n{END}{tail}"


if __name__ == "__main__":  # python -m treelit.cli.compositions --write docs/distributed.md
    import sys
    from pathlib import Path

    if len(sys.argv) == 3 and sys.argv[1] == "--write":
        target = Path(sys.argv[2])
        target.write_text(docs_section(target.read_text()))
    else:
        print(refusal_table())
