"""``treelit-train``: compose an experiment from config groups, train with Lightning, track in MLflow.

    treelit-train                                   # tiny model, bundled synthetic agent data, CPU
    treelit-train model.hf_checkpoint=DIR data=jsonl data.train_path=trees.jsonl optimizer=sgd
    treelit-train experiment=tau_bench_sft          # real tau-bench trajectories, chat builder
    treelit-train --help                            # all groups and options

Reads top to bottom: validate options, build model, data (trees checked against the
model), objective, module, callbacks, loggers, trainer; fit; export.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Dict, List

import hydra
from omegaconf import DictConfig, OmegaConf

from treelit.cli.config import CONF_DIR, register_resolvers, validate_config

log = logging.getLogger("treelit.train")


def build(node: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` that surfaces treelit's own error (which names the
    option and the known choices) instead of Hydra's wrapper around it."""
    from hydra.errors import InstantiationException

    try:
        return hydra.utils.instantiate(node, **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__
        if isinstance(cause, (ValueError, KeyError, OSError)):
            raise cause from None
        raise


def _instantiate_all(group: Any) -> List[Any]:
    if not group:
        return []
    return [build(node) for node in group.values() if node]


def _flat_params(cfg: DictConfig) -> Dict[str, Any]:
    flat: Dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = node

    walk("", OmegaConf.to_container(cfg, resolve=True))
    return {k: v for k, v in flat.items() if not k.startswith("hydra")}


def run(cfg: DictConfig) -> Dict[str, Any]:
    import lightning.pytorch as pl

    from treelit.lightning.module import TreeLitModule

    validate_config(cfg)
    pl.seed_everything(cfg.seed, workers=True)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))

    model = build(cfg.model)
    from treelit.ssm import set_ssm_backend

    set_ssm_backend(model, cfg.ssm.name, cfg.ssm.get("chunk_size", 64))
    builder = build(cfg.tree_builder)
    datamodule = build(cfg.data, tree_builder=builder)
    objective = build(cfg.objective)
    datamodule.check_against(model.tok_embeddings.num_embeddings, getattr(model, "max_seq_len", None), objective=objective)
    data_stats = datamodule.stats()
    log.info("data: %s", data_stats)

    module = TreeLitModule(
        model=model,
        objective=objective,
        optimizer=build(cfg.optimizer),
        scheduler=build(cfg.scheduler) if cfg.get("scheduler") else None,
        attention=build(cfg.attention),
        aggregation=cfg.aggregation,
        mode=cfg.mode,
        grad_clip=cfg.grad_clip,
        verify_every=cfg.verify_every,
        chunk_rows=cfg.chunk_rows,
        ppo_epochs=cfg.ppo_epochs,
        ppo_minibatches=cfg.ppo_minibatches,
        old_logprobs=cfg.old_logprobs,
        partition=cfg.partition.name,
        budget_tokens=cfg.partition.get("budget_tokens"),
    )
    callbacks = _instantiate_all(cfg.get("callbacks"))
    loggers = _instantiate_all(cfg.get("logger"))
    trainer = build(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    for lg in loggers:
        lg.log_hyperparams(_flat_params(cfg))
        if type(lg).__name__ == "MLFlowLogger":
            lg.log_metrics({f"data/{k}": float(v) for k, v in data_stats.items()}, step=0)
            lg.experiment.log_artifact(lg.run_id, str(out / "config.yaml"))
    trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.resume_from)
    summary = {
        "output_dir": str(out),
        "global_step": trainer.global_step,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "data": data_stats,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    for lg in loggers:
        if type(lg).__name__ == "MLFlowLogger":
            lg.experiment.log_artifact(lg.run_id, str(out / "summary.json"))
            ckpt_dir = out / "checkpoints"
            last = ckpt_dir / "last.ckpt"
            if last.is_file():
                lg.experiment.log_artifact(lg.run_id, str(last), artifact_path="checkpoints")
    return summary


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    run(cfg)


def main() -> None:
    register_resolvers()
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    _hydra_main()


if __name__ == "__main__":
    main()
