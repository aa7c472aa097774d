"""HSDP (``trainer.strategy.replicate_degree``): four CPU processes (gloo) as 2 replicas x 2
shards give one process's loss and gradients (float64), with partitioning and ranks that
hold different trees; every parameter is sharded over the 2 ranks of its replica (half of
it per rank, not a quarter) and replicated across replicas."""

from __future__ import annotations

import pytest
import torch

from cases import exact_steps
from harness import launch
from test_fsdp_exact import check


def shard_layout(rank: int, world: int, replicas: int):
    """Each rank's share of the parameters and the placements of the sharded parameters."""
    from helpers import tiny_model
    from treelit.utils.distributed import hsdp_mesh, shard_model

    model = tiny_model("qwen2_tiny", torch.float64)
    total = sum(p.numel() for p in model.parameters())
    mesh = hsdp_mesh(replicas, world)
    shard_model(model, mesh["data_parallel"])
    local = sum(p.to_local().numel() for p in model.parameters())
    p = next(model.parameters())
    from treelit.utils.distributed import Collectives

    locals_ = Collectives().gather_lists([local])
    return {"total": total, "local": [x[0] for x in locals_], "ndim": p.device_mesh.ndim,
            "placements": [type(pl).__name__ for pl in p.placements], "dims": p.device_mesh.mesh_dim_names}


HSDP = [
    dict(family="qwen2_tiny", objective="sft", replicas=2, limits=[90000, 40000, 70000, 300000], n_trees=8,
         micro_tokens=120),
    dict(family="hybrid_tiny", objective="grpo", data="rl", rollout=True, replicas=2, n_trees=8,
         limits=[60000, 36000, 36000, 200000], aggregation="seq-mean-token-mean"),
]


def hsdp_case(rank: int, world: int, specs):
    return exact_steps(rank, world, specs), shard_layout(rank, world, 2)


def test_replicate_degree_is_checked_before_training():
    from hydra.utils import instantiate

    from treelit.cli.config import ConfigError, compose, validate_config

    validate_config(compose(["trainer=fsdp2_cpu", "trainer.devices=2", "trainer.num_nodes=2",
                             "trainer.strategy.replicate_degree=2"]))
    with pytest.raises(ConfigError, match=r"replicate_degree=3 .* must divide the 4 processes"):
        validate_config(compose(["trainer=fsdp2_cpu", "trainer.devices=2", "trainer.num_nodes=2",
                                 "trainer.strategy.replicate_degree=3"]))
    with pytest.raises(Exception, match="replicate_degree must be a positive number"):
        instantiate(compose(["trainer=fsdp2_cpu", "trainer.strategy.replicate_degree=0"]).trainer.strategy)
    assert instantiate(compose(["trainer=fsdp2_cpu"]).trainer.strategy).replicate_degree == 1


@pytest.mark.slow  # about 3 minutes on 2 cores
def test_hsdp_2x2_equals_one_process_and_shards_within_a_replica():
    """One launch (four processes start slowly): the exact step, then the layout of the shards."""
    exact, layout = launch(hsdp_case, 4, HSDP[:1], deadline=600)
    check(exact[0], HSDP[0], 4)
    assert len(set(exact[0]["partitions"])) > 1, exact[0]
    assert layout["ndim"] == 2 and layout["dims"] == ("dp_replicate", "dp_shard"), layout
    assert layout["placements"] == ["Replicate", "Shard"], layout
    # 2 shards per replica: each rank holds about half of the parameters (rows padded), not FSDP2's quarter
    for local in layout["local"]:
        assert layout["total"] / 2 * 0.95 <= local <= layout["total"] / 2 * 1.1, layout


@pytest.mark.slow
def test_hsdp_2x2_partitioned_rl_equals_one_process():
    res = launch(exact_steps, 4, HSDP[1:], deadline=900)
    check(res[0], HSDP[1], 4)
