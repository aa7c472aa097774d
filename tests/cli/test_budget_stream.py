"""A fixed partition budget that holds the trees a stream read before training but not a longer
tree streamed later: training stops at that tree with one ``error:`` line naming
``partition.budget_tokens`` and the length needed, no traceback."""

from __future__ import annotations

import json


def test_a_longer_tree_streamed_later_is_one_error_line_naming_the_option(cli_main, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    with open(data, "w") as f:
        for i in range(40):  # short trees first: the budget holds what is read before training
            f.write(json.dumps({"branches": [{"input_ids": [1, 2, 3, 4 + i % 5, 5, 6]},
                                             {"input_ids": [1, 2, 3, 7, 8]}]}) + "\n")
        f.write(json.dumps({"branches": [{"input_ids": list(range(1, 41))}]}) + "\n")  # 40 tokens
    code = cli_main("data=stream", f"data.source.paths={data}", "data.shuffle=false", "data.micro_batch_tokens=64",
                    "partition=redundancy_free", "partition.budget_tokens=20", "trainer.max_steps=30", "logger=none",
                    "callbacks.checkpoint=null", "callbacks.hf_export=null", f"output_dir={tmp_path / 'run'}")
    err = capsys.readouterr().err
    assert code != 0
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: partition.budget_tokens: partition budget of 20 tokens"), lines[0]
    assert "at least 40" in lines[0]
    assert "Traceback" not in err
