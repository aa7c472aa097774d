"""Overrides that shrink the real config to CPU test size."""

SMALL = [
    "logger=none",
    "callbacks.checkpoint=null",
    "trainer.enable_progress_bar=false",
    "callbacks.progress=null",
    "model.config.num_layers=2",
    "model.config.embed_dim=32",
    "model.config.intermediate_dim=64",
]
