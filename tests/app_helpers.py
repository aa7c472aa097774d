"""Shared test pieces: overrides that shrink the real config to CPU test size; a callback that
stalls a training subprocess where a test kills it."""

SMALL = [
    "logger=none",
    "callbacks.checkpoint=null",
    "trainer.enable_progress_bar=false",
    "callbacks.progress=null",
    "model.config.num_layers=2",
    "model.config.embed_dim=32",
    "model.config.intermediate_dim=64",
]

# A callback module that training subprocesses load (``callbacks.stall._target_=stall.Stall``) to be
# killed at a known point: it writes its pid to `marker` and sleeps inside step `at_step` + 1.
STALL = '''
import os, time
import lightning.pytorch as pl

class Stall(pl.Callback):
    """Stops inside optimizer step `at_step` + 1: after its backward, before its update."""
    def __init__(self, at_step, marker):
        self.at_step, self.marker = int(at_step), marker
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.at_step:
            with open(self.marker, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(600)
'''
