"""``treelit-train compile=...``: the run says which layers it compiled and trains to the eager
run's weights (two SGD steps, float32)."""

from __future__ import annotations

import pytest
import torch

from cli_helpers import TINY


def _weights(run_dir):
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


@pytest.mark.slow
def test_compiled_run_trains_to_the_eager_weights(tmp_path, cli_main, capsys):
    runs = {}
    for setting in ("false", "aot_eager"):
        out = tmp_path / setting
        status = cli_main(*TINY, "model.config.num_layers=2", "logger=none", "trainer.max_steps=2", "optimizer=sgd",
                          f"compile={setting}", f"output_dir={out}")
        captured = capsys.readouterr()
        assert status == 0, captured.err
        runs[setting] = _weights(out)
        if setting != "false":
            assert "compile=aot_eager: 2 layers run compiled; the first step compiles" in captured.err + captured.out
    for name, w in runs["false"].items():
        torch.testing.assert_close(runs["aot_eager"][name], w, rtol=1e-5, atol=1e-6, msg=name)
