"""A fixed partition budget below the data's longest branch is one error naming the option,
before training (in-memory data), and during training for a tree streamed later."""

from __future__ import annotations

from treelit.cli.console import user_error_message
from treelit.partition import BudgetError


def test_budget_below_the_longest_branch_fails_before_training(cli_main, tmp_path, capsys):
    code = cli_main(*["experiment=rl_synthetic", "partition=redundancy_free",
                     "partition.budget_tokens=8", "trainer.max_steps=2", "logger=none",
                     f"output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code != 0
    line = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(line) == 1, err
    assert "partition.budget_tokens=8 cannot hold the longest branch of the data" in line[0]
    assert "Traceback" not in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_budget_error_in_training_is_a_user_error_naming_the_option():
    exc = BudgetError("partition budget of 40 tokens cannot hold one root-to-leaf path: the longest branch has 47 "
                      "tokens; use a budget of at least 47")
    assert user_error_message(exc).startswith("partition.budget_tokens: partition budget of 40 tokens")


def test_budget_that_holds_the_longest_branch_trains(cli_main, tmp_path):
    code = cli_main(*["experiment=rl_synthetic", "partition=redundancy_free",
                     "partition.budget_tokens=4096", "trainer.max_steps=1", "logger=none",
                     f"output_dir={tmp_path / 'run'}"])
    assert code == 0
