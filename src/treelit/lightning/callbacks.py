"""Callbacks: a progress bar that knows the step budget, and the Hugging Face export."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar

log = logging.getLogger(__name__)


class TreeProgressBar(TQDMProgressBar):
    """TQDM bar over optimizer steps (the data stream is endless, so the total is ``max_steps``);
    shows loss, tree tokens/s and effective (flat) tokens/s."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if trainer.max_steps and trainer.max_steps > 0:
            self.train_progress_bar.reset(total=trainer.max_steps)
            self.train_progress_bar.n = trainer.global_step
            self.train_progress_bar.refresh()

    def get_metrics(self, trainer, pl_module):
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items


class HFExport(pl.Callback):
    """Write the model as a Hugging Face checkpoint at the end of training (and log it to MLflow)."""

    def __init__(self, dirpath: str, log_to_mlflow: bool = True) -> None:
        self.dirpath = dirpath
        self.log_to_mlflow = log_to_mlflow
        self.saved: Optional[Path] = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from treelit.models.hf import full_state_dict, save_hf_checkpoint

        sd = full_state_dict(pl_module.model)  # a collective under FSDP2: every rank gathers
        if not trainer.is_global_zero:
            return
        self.saved = save_hf_checkpoint(pl_module.model, self.dirpath, state_dict=sd, native_fallback=True)
        log.info("wrote Hugging Face checkpoint to %s", self.saved)
        if self.log_to_mlflow:
            for lg in trainer.loggers:
                if type(lg).__name__ == "MLFlowLogger":
                    lg.experiment.log_artifacts(lg.run_id, str(self.saved), artifact_path="hf_checkpoint")


class RewardMargin(pl.Callback):
    """Tracks how the policy's probability of high-reward branches moves against low-reward ones.

    Every ``every_n_steps`` optimizer steps it computes, on the first ``max_trees`` training
    trees, each branch's mean log-prob per target token (tree mode, no gradient) and logs the
    means over branches with reward above/below ``threshold`` and their difference
    (``reward/logp_high``, ``reward/logp_low``, ``reward/margin``). At the end it saves a PNG
    plot to ``plot_path`` and logs it to MLflow.
    """

    def __init__(self, plot_path: str, every_n_steps: int = 5, max_trees: int = 16, threshold: float = 0.5) -> None:
        self.plot_path = plot_path
        self.every = int(every_n_steps)
        self.max_trees = int(max_trees)
        self.threshold = float(threshold)
        self.history: list = []

    def _measure(self, trainer, pl_module) -> None:
        import numpy as np
        import torch

        from treelit.loss.tree import tree_token_logprobs
        from treelit.objectives.paths import branch_target_sums

        dm = trainer.datamodule
        high, low = [], []
        was_training = pl_module.model.training
        pl_module.model.eval()
        with torch.no_grad():
            for t in dm.trees[: self.max_trees]:
                rewards = t.tree.branch_fields.get("reward")
                if rewards is None:
                    continue
                batch = t.tree.to_batch().to(pl_module.device)
                sel, logp, _ = tree_token_logprobs(pl_module.model, batch, pl_module.attention)
                x = torch.zeros(batch.num_tokens, dtype=torch.float64, device=batch.device).index_put((sel,), logp.double())
                sums = branch_target_sums(batch, x).cpu().numpy()
                n = np.array([m[1:].sum() for m in np.split(batch.branch_mask.cpu().numpy(), batch.branch_ptr.cpu().numpy()[1:-1])])
                for s, k, r in zip(sums, n, rewards):
                    if k and r is not None:
                        (high if r > self.threshold else low).append(s / k)
        pl_module.model.train(was_training)
        if not high or not low:
            return
        row = {"step": trainer.global_step, "logp_high": float(np.mean(high)), "logp_low": float(np.mean(low))}
        row["margin"] = row["logp_high"] - row["logp_low"]
        self.history.append(row)
        for k, v in row.items():
            if k != "step":
                trainer.callback_metrics[f"reward/{k}"] = torch.tensor(v)
        for lg in trainer.loggers:
            lg.log_metrics({f"reward/{k}": v for k, v in row.items() if k != "step"}, step=trainer.global_step)

    def on_train_start(self, trainer, pl_module) -> None:
        self._measure(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.every and trainer.global_step % self.every == 0:
            self._measure(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if not self.history or not trainer.is_global_zero:
            return
        if self.history[-1]["step"] != trainer.global_step:
            self._measure(trainer, pl_module)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [h["step"] for h in self.history]
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
        ax.plot(steps, [h["logp_high"] for h in self.history], label="reward 1 branches")
        ax.plot(steps, [h["logp_low"] for h in self.history], label="reward 0 branches")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("mean log-prob per target token")
        ax2 = ax.twinx()
        ax2.plot(steps, [h["margin"] for h in self.history], "k--", label="margin")
        ax2.set_ylabel("margin (high - low)")
        ax.legend(loc="upper left", fontsize=8)
        ax2.legend(loc="lower right", fontsize=8)
        ax.set_title("policy probability of high- vs low-reward branches")
        fig.tight_layout()
        Path(self.plot_path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(self.plot_path)
        plt.close(fig)
        log.info("saved %s", self.plot_path)
        for lg in trainer.loggers:
            if type(lg).__name__ == "MLFlowLogger":
                lg.experiment.log_artifact(lg.run_id, self.plot_path)
