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
        if not trainer.is_global_zero:
            return
        from treelit.models.hf import save_hf_checkpoint

        self.saved = save_hf_checkpoint(pl_module.model, self.dirpath)
        log.info("wrote Hugging Face checkpoint to %s", self.saved)
        if self.log_to_mlflow:
            for lg in trainer.loggers:
                if type(lg).__name__ == "MLFlowLogger":
                    lg.experiment.log_artifacts(lg.run_id, str(self.saved), artifact_path="hf_checkpoint")
