"""RL through treelit-train: the synthetic GRPO example and PPO epochs with rollout log-probs."""

from __future__ import annotations

import json

import torch

import treelit
from app_helpers import SMALL
from treelit.cli.config import compose
from treelit.cli.train import run


def test_experiment_presets_set_their_run_level_options():
    """A preset's own run-level settings (aggregation, PPO epochs, rollout log-probs) are not
    overridden by the root config's defaults; the command line still wins over the preset."""
    cfg = compose(["experiment=rl_synthetic"])
    assert (cfg.aggregation, cfg.ppo_epochs, cfg.old_logprobs) == ("seq-mean-token-mean", 2, "rollout")
    cfg = compose(["experiment=tau_bench_grpo"])
    assert (cfg.aggregation, cfg.old_logprobs) == ("seq-mean-token-mean", "rollout")
    cfg = compose(["experiment=rl_synthetic", "aggregation=sum", "ppo_epochs=3"])
    assert (cfg.aggregation, cfg.ppo_epochs) == ("sum", 3)


def test_rl_example_raises_high_reward_probability(tmp_path):
    cfg = compose([f"output_dir={tmp_path / 'rl'}", "experiment=rl_synthetic", *SMALL, "trainer.max_steps=40",
                   "callbacks.reward_margin.every_n_steps=20", "callbacks.reward_margin.max_trees=8"])
    summary = run(cfg)
    assert summary["global_step"] == 40
    assert (tmp_path / "rl" / "reward_margin.png").is_file()
    m = summary["metrics"]
    assert m["reward/margin"] > 0.5, m  # high-reward completions now more likely than low-reward ones
    for key in ("clip_frac", "approx_kl", "adv_mean", "adv_std"):
        assert key in m, key


def test_reward_margin_on_a_streamed_source(tmp_path):
    """The reward-margin callback measures on the first step's rows when the data is streamed
    (the data module holds no trees)."""
    from treelit.cli.config import bundled_path

    cfg = compose([f"output_dir={tmp_path / 'rl'}", "experiment=rl_synthetic", *SMALL, "trainer.max_steps=4",
                   "data=stream", f"data.source.paths={bundled_path('synthetic_rollouts.jsonl.gz')}",
                   "callbacks.reward_margin.every_n_steps=2", "callbacks.reward_margin.max_trees=4"])
    summary = run(cfg)
    assert summary["global_step"] == 4
    assert "reward/margin" in summary["metrics"]


def test_ppo_epochs_with_rollout_logprobs_equal_a_hand_loop(tmp_path):
    """Two PPO epochs on one step batch: the second epoch's ratios are measured against the
    rollout policy, exactly as a hand-written loop over the same trees computes them."""
    data = tmp_path / "groups.jsonl"
    recs = [{"id": "g", "branches": [
        {"input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 0, 1, 1, 1], "advantage": 1.0},
        {"input_ids": [1, 2, 3, 6, 7], "loss_mask": [0, 0, 1, 1, 1], "advantage": -1.0},
        {"input_ids": [1, 2, 8], "loss_mask": [0, 0, 1], "advantage": 0.5}]}]
    data.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    from helpers import tiny_model

    src = tiny_model("qwen2_tiny", torch.float32, max_seq_len=64)
    ckpt = treelit.save_hf_checkpoint(src, tmp_path / "ckpt")
    common = [f"model.hf_checkpoint={ckpt}", "data=jsonl", f"data.train_path={data}", "objective=ppo",
              "optimizer=sgd", "optimizer.lr=0.5", "old_logprobs=rollout", "ppo_epochs=2", "trainer.max_steps=2",
              "grad_clip=0"]
    run(compose([f"output_dir={tmp_path / 'run'}", *SMALL, *common]))
    got = treelit.load_hf_checkpoint(tmp_path / "run" / "hf_checkpoint").state_dict()

    model = treelit.load_hf_checkpoint(ckpt)
    b = recs[0]["branches"]
    tree = treelit.TokenTree.from_branches([x["input_ids"] for x in b], [x["loss_mask"] for x in b],
                                           advantages=[x["advantage"] for x in b])
    from treelit.loss.tree import tree_token_logprobs
    from treelit.objectives import make_objective

    batch = tree.to_batch()
    with torch.no_grad():
        sel, lp, _ = tree_token_logprobs(model, batch, "auto")
    old = torch.full((batch.num_tokens,), float("nan"), dtype=torch.float64)
    old[sel] = lp.double()
    batch.token_old_logp, batch.branch_old_logp = old, old[batch.branch_tokens]
    obj = make_objective("ppo")
    for _ in range(2):
        model.zero_grad()
        loss, _ = obj.tree_loss(model, batch, aggregation="token-mean", normalizer=None)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.5 * p.grad
    ref = model.state_dict()
    moved = max((ref[k] - src.state_dict()[k]).abs().max().item() for k in ref)
    assert moved > 1e-4
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-6, msg=k)


def test_rl_run_logs_the_rewards_to_mlflow(tmp_path, cli_main):
    """``reward/mean`` / ``min`` / ``max`` of each step's branches reach the MLflow run (they were
    only in the rollout worker's output and in summary.json)."""
    import sqlite3

    db = tmp_path / "mlflow.db"
    status = cli_main("experiment=rl_synthetic", "trainer.max_steps=2", "trainer.log_every_n_steps=1",
                      f"logger.mlflow.tracking_uri=sqlite:///{db}", f"output_dir={tmp_path / 'out'}")
    assert status == 0
    with sqlite3.connect(db) as con:
        rows = dict(con.execute("SELECT key, value FROM metrics WHERE key LIKE 'reward/%' ORDER BY step DESC"))
    assert {"reward/mean", "reward/min", "reward/max"} <= set(rows), rows
    assert rows["reward/min"] <= rows["reward/mean"] <= rows["reward/max"] and rows["reward/max"] > rows["reward/min"]
