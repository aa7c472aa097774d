"""``treelit list`` prints names that work as config options; ``treelit stats`` reads every
bundled file and chat data, with one-line errors."""

from __future__ import annotations

import json

import pytest

from treelit.cli.config import compose
from treelit.cli.main import NAME_KEY, SELECT, config_options, main
from treelit.components import all_registries


def test_every_listed_name_works_as_the_option_it_is_listed_under():
    regs = all_registries()
    assert set(SELECT) <= set(regs), "a kind selected in the config is not a registry"
    checked = 0
    for kind, how in SELECT.items():
        options = config_options(kind) if how == "" else []
        for name in regs[kind].names():
            if how == "":
                assert name in options, f"`treelit list` shows {kind} {name!r} but {kind}={name} fails"
                cfg = compose([f"{kind}={name}"])
                assert cfg[kind][NAME_KEY.get(kind, "name")] == name, (kind, name)
            else:
                group, key = how.split(".")
                assert compose([f"{how}={name}"])[group][key] == name
            checked += 1
    assert checked > 20


def test_list_prints_every_name_with_how_to_select_it(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for kind, reg in all_registries().items():
        for name in reg.names():
            assert f"  {name} " in out, (kind, name)
    assert "model  (select with model=NAME)" in out
    assert "advantage  (select with tree_builder.advantage=NAME)" in out
    assert "config presets: " in out and "tiny" in out
    assert "no config file" not in out  # every built-in has one


@pytest.mark.parametrize("name,trees", [("synthetic_agentic.jsonl.gz", "240"), ("synthetic_rollouts.jsonl.gz", "64")])
def test_stats_reads_the_bundled_token_files_by_name(name, trees, capsys):
    assert main(["stats", name]) == 0
    out = capsys.readouterr().out
    assert "builder: sequences" in out and f"trees: {trees}" in out and "ideal_speedup:" in out


@pytest.mark.slow
def test_stats_reads_the_bundled_tau_bench_conversations(capsys):
    assert main(["stats", "tau_bench_airline/gpt-4o-airline.json.gz", "--group-key", "task_id"]) == 0
    out = capsys.readouterr().out
    assert "builder: chat" in out and "trees: 50" in out


def test_stats_reads_chat_data_with_the_bundled_tokenizer(tmp_path, capsys):
    conv = [{"role": "system", "content": "You book flights."}, {"role": "user", "content": "Paris, please."},
            {"role": "assistant", "content": "Which day?"}, {"role": "user", "content": "Friday."},
            {"role": "assistant", "content": "Booked for Friday."}]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"id": "c0", "messages": conv}) + "\n"
                    + json.dumps({"id": "c1", "messages": conv[:3] + [{"role": "user", "content": "Rome."}]
                                  + [{"role": "assistant", "content": "Booked Rome."}]}) + "\n")
    assert main(["stats", str(path), "--group-key", "id"]) == 0
    out = capsys.readouterr().out
    assert "builder: chat (tokenizer " in out and "trees: 2" in out
    assert main(["stats", str(path)]) == 0  # per conversation, no group key
    out = capsys.readouterr().out
    flat = int(next(line for line in out.splitlines() if "flat_tokens" in line).split(":")[1].replace(",", ""))
    tree = int(next(line for line in out.splitlines() if "tree_tokens" in line).split(":")[1].replace(",", ""))
    assert 0 < tree < flat  # per-call export: each conversation's calls share their contexts


def test_stats_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "branches": [{"input_ids": [1, 2]}]}\n{oops\n')
    cases = [(["stats", str(tmp_path / "missing.jsonl")], "missing.jsonl: no such data file"),
             (["stats", str(bad)], f"{bad}:2: invalid JSON"),
             (["stats", "synthetic_rollouts.jsonl.gz", "--builder", "nope"], "unknown tree_builder 'nope'")]
    for argv, expected in cases:
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert f"treelit stats: error: " in err and expected in err and "Traceback" not in err, err


def _vision_chat(tmp_path):
    """A processor folder (Qwen's vision tokens, a tiny image processor) and two conversations
    whose calls show one shared screenshot and one of their own."""
    import numpy as np

    from vision_oracle import random_image, vl_processor_dir

    proc = vl_processor_dir(tmp_path / "proc")
    rng = np.random.default_rng(0)
    for name in ("home", "a", "b"):
        random_image(rng, 16, 24).save(tmp_path / f"{name}.png")

    def conv(shot):
        return [{"role": "user", "content": [{"type": "image", "image": "home.png"}, {"type": "text", "text": "go"}]},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": [{"type": "image", "image": f"{shot}.png"}]},
                {"role": "assistant", "content": "done"}]

    path = tmp_path / "agent.jsonl"
    path.write_text("".join(json.dumps({"id": s, "group": "g", "messages": conv(s)}) + "\n" for s in ("a", "b")))
    return path, proc


def test_stats_reads_image_records_with_a_processor(tmp_path, capsys):
    """Its error once asked for tree_builder.processor_path, an option treelit stats does not have."""
    pytest.importorskip("PIL")
    path, proc = _vision_chat(tmp_path)
    assert main(["stats", str(path)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "pass --processor with the vision checkpoint's folder" in err, err
    assert "tree_builder" not in err
    assert main(["stats", str(path), "--processor", str(proc), "--group-key", "group"]) == 0
    out = capsys.readouterr().out
    assert f"(processor {proc})" in out and "trees: 1" in out
    # four calls: the first two show home.png only (one shared prefix), the last two home.png and their own
    assert "images: 6" in out and "distinct_images: 3" in out and "shared_images: 1" in out, out


def test_stats_reads_recorded_moe_routing(tmp_path, capsys):
    from treelit.tree.routing import encode_routing

    path = tmp_path / "moe.jsonl"
    rows = [{"id": f"r{i}", "branches": [{"input_ids": [1, 2, 3 + i], "routed_experts": [[[0, 1], [2, 3]]] * 3},
                                         {"input_ids": [1, 2, 9],  # (the shared tokens agree)
                                          "routed_experts": encode_routing([[[0, 1], [2, 3]]] * 2 + [[[0, 5], [1, 2]]])},
                                         {"input_ids": [1, 7]}]} for i in range(2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["stats", str(path)]) == 0
    out = capsys.readouterr().out
    for line in ("routed_branches: 4", "moe_layers: 2", "top_k: 2", "max_expert_id: 5"):
        assert line in out, (line, out)
    rows[1]["branches"][0]["routed_experts"] = [[[0, 1], [2]]] * 3  # ragged: checked as training checks it
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["stats", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{path}:2: branches[0].routed_experts" in err and len(err.strip().splitlines()) == 1, err


def test_data_train_path_takes_a_bundled_name_as_treelit_stats_does(tmp_path):
    from app_helpers import SMALL
    from treelit.cli.config import ConfigError, validate_config
    from treelit.cli.train import run

    cfg = compose([*SMALL, "data=jsonl", "data.train_path=synthetic_agentic.jsonl.gz", "data.max_trees=4",
                   "trainer.max_steps=1", "logger=none", f"output_dir={tmp_path / 'out'}"])
    validate_config(cfg)
    summary = run(cfg)
    assert summary["global_step"] == 1 and summary["data"]["trees"] == 4
    with pytest.raises(ConfigError, match=r"data.train_path: data file 'synthetic_agentic.jsonl' does not exist \(nor "
                                          r"is it a bundled data file: .*synthetic_agentic.jsonl.gz"):
        validate_config(compose(["data=jsonl", "data.train_path=synthetic_agentic.jsonl"]))
