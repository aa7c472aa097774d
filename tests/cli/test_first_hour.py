"""The first hour of a new user: a console without library noise, plain progress lines in a
redirected log, honest data lines for streams, an RL summary in RL terms, a chat-data error
that names the model to use, one-line config typos with the closest names, and a
``treelit list`` that selects every kind the way the README does."""

from __future__ import annotations

import json
import logging
import re
import socket
import sys
import types
from pathlib import Path

import pytest

from cli_helpers import TINY
from treelit.cli.console import ConsoleFormatter, ConsoleHandler, hydra_error_message, tidy_library_logging

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def console(monkeypatch):
    """The console handler on the root logger as Hydra installs it, and every record that
    reached the root (what ``train.log`` gets)."""
    root = logging.getLogger()
    handler = ConsoleHandler()
    handler.setFormatter(ConsoleFormatter())
    seen = []
    keeper = logging.Handler()
    keeper.emit = lambda record: seen.append(record.getMessage())
    level = root.level
    root.addHandler(handler)
    root.addHandler(keeper)
    root.setLevel(logging.INFO)
    tidy_library_logging()
    yield seen
    root.removeHandler(handler)
    root.removeHandler(keeper)
    root.setLevel(level)


# the console: no library noise ---------------------------------------------------------------


def test_lightning_device_report_and_ddp_banner_stay_out_of_the_console(console, capsys, monkeypatch):
    """Lightning's own calls: the Trainer's device report and the distributed start-up banner
    (a one-process gloo group). train.log keeps them."""
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.fabric.utilities.distributed import _init_dist_connection

    tidy_library_logging()  # after Lightning's import, as treelit-train does
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    _init_dist_connection(LightningEnvironment(), "gloo", global_rank=0, world_size=1)
    dist.destroy_process_group()
    text = "\n".join(capsys.readouterr())
    for noise in ("GPU available", "TPU available", "HPU available", "Initializing distributed",
                  "distributed_backend=", "All distributed processes registered", "-" * 40):
        assert noise not in text, (noise, text)
    kept = "\n".join(console)
    assert "GPU available: False" in kept and "Initializing distributed: GLOBAL_RANK: 0" in kept
    assert "All distributed processes registered" in kept


def test_transformers_bars_are_off_in_treelit_train_only(tmp_path, capfd):
    """"Loading weights" (and "Writing model shards") are transformers' own bars: the library
    shows them, treelit-train's quiet_transformers_bars turns them off."""
    pytest.importorskip("transformers")
    from transformers.utils import logging as hf_logging

    import treelit
    from treelit.cli.console import quiet_transformers_bars
    from treelit.models.hf_adapter import load_hf_model

    path = treelit.save_hf_checkpoint(treelit.build_model("qwen2_tiny"), tmp_path / "hf")
    capfd.readouterr()
    previous = hf_logging.set_tqdm_hook(None)
    try:
        load_hf_model(path)
        assert "Loading weights" in capfd.readouterr().err  # the bar exists: this test can fail
        quiet_transformers_bars()
        model = load_hf_model(path)
        model.save_pretrained(tmp_path / "again")
        out, err = capfd.readouterr()
        assert "Loading weights" not in out + err and "Writing model shards" not in out + err
    finally:
        hf_logging.set_tqdm_hook(previous)


def test_treelit_train_quiets_transformers_for_transformers_models_only(tmp_path, cli_main, monkeypatch):
    from treelit.cli import train

    calls = []
    monkeypatch.setattr(train, "quiet_transformers_bars", lambda: calls.append("quiet"))
    monkeypatch.setattr(train, "run", lambda cfg: calls.append(cfg.model._target_))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")  # (the files the config names are checked first)
    assert cli_main("model=hf_auto", f"model.hf_checkpoint={tmp_path / 'hf'}", "logger=none",
                    f"output_dir={tmp_path / 'a'}") == 0
    assert cli_main("logger=none", f"output_dir={tmp_path / 'b'}") == 0
    assert calls == ["quiet", "treelit.models.hf_adapter.make_hf_model", "treelit.models.factory.make_model"]


# plain progress lines ------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _fake_run(bar, steps: int, seconds_per_step: float, clock: _Clock, stdout) -> None:
    trainer = types.SimpleNamespace(global_step=0, max_steps=steps, is_global_zero=True)
    bar.get_metrics = lambda trainer, module: {"loss": 5.8123, "tree_tok/s": 2954.2, "flat_tok/s": 11610.0}
    old = sys.stdout
    sys.stdout = stdout
    try:
        bar.setup(trainer, None, "fit")
    finally:
        sys.stdout = old
    if bar._lines:  # what Lightning's on_train_start would do, without a real bar
        bar._start, bar._last_line = (clock(), 0), None
    for n in range(1, steps + 1):
        clock.t += seconds_per_step
        trainer.global_step = n
        if bar._lines:
            bar.on_train_batch_end(trainer, None, {"loss": 5.8}, None, n - 1)


def test_a_redirected_run_prints_a_few_plain_lines_not_bar_frames(monkeypatch, caplog):
    """300 steps of 0.25 s written to a file: the first step, one line per 20 s, the last step."""
    from treelit.lightning import callbacks
    from treelit.lightning.callbacks import TreeProgressBar

    clock = _Clock()
    monkeypatch.setattr(callbacks.time, "monotonic", clock)

    class File:
        def isatty(self):
            return False

    bar = TreeProgressBar(log_every_s=20)
    with caplog.at_level(logging.INFO, logger="treelit.lightning.callbacks"):
        _fake_run(bar, 300, 0.25, clock, File())
    lines = [r.getMessage() for r in caplog.records if r.name == "treelit.lightning.callbacks"]
    assert bar._lines and not bar.is_enabled  # Lightning's bar draws nothing
    # the first step's line gives no estimate: a first step pays for compilation and warm-up
    assert lines[0] == "step 1/300: loss 5.812, tree_tok/s 2,954, flat_tok/s 11,610 (0s)"
    assert lines[1] == "step 81/300: loss 5.812, tree_tok/s 2,954, flat_tok/s 11,610 (20s, about 55s left)"
    assert lines[-1] == "step 300/300: loss 5.812, tree_tok/s 2,954, flat_tok/s 11,610 (1m15s)"
    steps = [int(re.match(r"step (\d+)/300", x).group(1)) for x in lines]
    assert steps == [1, 81, 161, 241, 300], steps
    assert sum(len(x) + 1 for x in lines) < 600


def test_a_terminal_keeps_the_bar_and_plain_can_be_forced(monkeypatch, caplog):
    from treelit.lightning import callbacks
    from treelit.lightning.callbacks import TreeProgressBar

    class Terminal:
        def isatty(self):
            return True

    clock = _Clock()
    monkeypatch.setattr(callbacks.time, "monotonic", clock)
    bar = TreeProgressBar()
    _fake_run(bar, 5, 1.0, clock, Terminal())
    assert not bar._lines and bar.is_enabled
    forced = TreeProgressBar(plain=True, log_every_s=0)
    with caplog.at_level(logging.INFO, logger="treelit.lightning.callbacks"):
        _fake_run(forced, 5, 1.0, clock, Terminal())
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [f"step {n}/5" for n in range(1, 6)]


def test_the_time_left_is_not_extrapolated_from_the_first_step(monkeypatch, caplog):
    """A 39 s run whose first step took 30 s was told "about 4m52s left" after it: the estimate
    comes from the steps after the first."""
    from treelit.lightning import callbacks
    from treelit.lightning.callbacks import TreeProgressBar

    clock = _Clock()
    monkeypatch.setattr(callbacks.time, "monotonic", clock)

    class File:
        def isatty(self):
            return False

    bar = TreeProgressBar(log_every_s=0)
    bar.get_metrics = lambda trainer, module: {}
    trainer = types.SimpleNamespace(global_step=0, max_steps=10, is_global_zero=True)
    old = sys.stdout
    sys.stdout = File()
    try:
        bar.setup(trainer, None, "fit")
    finally:
        sys.stdout = old
    bar._start, bar._last_line = (clock(), 0), None
    with caplog.at_level(logging.INFO, logger="treelit.lightning.callbacks"):
        for n, seconds in enumerate([30.0] + [1.0] * 9, start=1):
            clock.t += seconds
            trainer.global_step = n
            bar.on_train_batch_end(trainer, None, {"loss": 5.8}, None, n - 1)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:3] == ["step 1/10 (30s)", "step 2/10 (31s, about 8s left)", "step 3/10 (32s, about 7s left)"], lines
    assert lines[-1] == "step 10/10 (39s)"


def test_under_the_bar_the_step_lines_go_to_the_log_file_only(tmp_path, cli_main, capsys):
    """A run on a terminal draws the bar; its train.log still gets the step lines, its console
    does not (the bar shows them)."""
    out = tmp_path / "run"
    assert cli_main("model.config.num_layers=1", "model.config.embed_dim=32", "model.config.intermediate_dim=64",
                    "data.max_trees=8", "logger=none", "trainer.max_steps=3", "callbacks.progress.plain=false",
                    f"output_dir={out}") == 0
    logged = [ln for ln in (out / "train.log").read_text().splitlines() if re.search(r"step \d/3", ln)]
    assert [re.search(r"step (\d)/3", ln).group(1) for ln in logged] == ["1", "3"], logged
    printed = capsys.readouterr()
    assert not re.search(r"^step \d/3", printed.out, re.M), printed.out


# streamed data: counted as read ----------------------------------------------------------------


def test_a_stream_says_its_counts_are_what_was_read_so_far(tmp_path):
    import gzip

    from treelit.builders.base import make_tree_builder
    from treelit.cli.summary import data_line
    from treelit.data.sources import make_data_source
    from treelit.lightning.data import TreeDataModule
    from treelit.lightning.streaming import StreamingTreeDataModule

    bundled = REPO / "src" / "treelit" / "data" / "bundled" / "synthetic_agentic.jsonl.gz"
    records = gzip.open(bundled, "rt").read().splitlines()[:120]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(records) + "\n")
    m = StreamingTreeDataModule(make_data_source("files", paths=[str(path)]), make_tree_builder("sequences"),
                                micro_batch_tokens=4096, shuffle=False)
    m.check_against(512, None)
    s = m.stats()
    assert s["streamed"] and s["records_read"] == 120 and 0 < s["trees"] < 120
    line = data_line(s)
    assert line.startswith(f"streamed, not counted in advance; so far 120 records read, the first {s['trees']} trees, ")
    whole = TreeDataModule(train_path=str(path), tree_builder=make_tree_builder("sequences"))
    whole.setup()
    w = whole.stats()
    assert not w.get("streamed") and data_line(w).startswith(f"{w['trees']:,} trees, {w['branches']:,} branches")


def test_the_data_line_of_a_stream_with_nothing_read_yet():
    from treelit.cli.summary import data_line

    d = {"trees": 0, "branches": 0, "flat_tokens": 0, "tree_tokens": 0, "por": 0.0, "records_skipped": 0,
         "streamed": True, "records_read": 0}
    assert data_line(d) == "streamed, not counted in advance: nothing read yet"


# the RL summary --------------------------------------------------------------------------------


def test_an_rl_run_ends_with_reward_margin_kl_and_clip_fraction(tmp_path, cli_main, capsys):
    status = cli_main("experiment=rl_synthetic", "trainer.max_steps=4", "ppo_epochs=1", "logger=none",
                      "callbacks.hf_export=null", "callbacks.checkpoint=null", "callbacks.reward_margin.every_n_steps=2",
                      "callbacks.reward_margin.max_trees=2", "model.config.num_layers=1", "data.max_trees=16",
                      f"output_dir={tmp_path / 'out'}")
    out = capsys.readouterr().out
    assert status == 0, out[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    rl = summary["rl"]
    assert rl["first"]["step"] == 1 and rl["last"]["step"] == 4
    for k in ("reward_mean", "approx_kl", "clip_frac"):
        assert k in rl["first"] and k in rl["last"], k
    assert 0.0 <= rl["last"]["reward_mean"] <= 1.0  # the synthetic rewards are 0/1
    m = summary["reward_margin"]
    assert m["first"]["step"] == 0 and m["last"]["step"] == 4
    done = next(line for line in out.splitlines() if line.startswith("done: "))
    assert "loss" not in done  # a clipped policy loss starts near 0: not what an RL user reads
    assert f"  reward      mean {rl['first']['reward_mean']:.3f} -> {rl['last']['reward_mean']:.3f}" in out
    assert (f"  policy      KL to rollout policy {rl['first']['approx_kl']:.4g} -> {rl['last']['approx_kl']:.4g}, "
            f"clip fraction {rl['first']['clip_frac']:.4g} -> {rl['last']['clip_frac']:.4g} (step 1 -> 4)") in out
    assert f"  margin      {m['first']['margin']:.2f} -> {m['last']['margin']:.2f} nats (step 0 -> 4)" in out


def test_an_sft_summary_keeps_the_loss():
    from treelit.cli.summary import format_summary

    s = {"global_step": 3, "wall_seconds": 4.0, "loss": {"first": [1, 6.25], "last": [3, 6.1]}, "config": "c.yaml"}
    assert format_summary(s).splitlines()[0] == "done: 3 steps in 4s; loss 6.250 (step 1) -> 6.100 (step 3)"


# chat data and the model's vocabulary ------------------------------------------------------------


def test_chat_data_beyond_the_model_vocabulary_names_a_model_with_the_tokenizers(tmp_path):
    from treelit.builders.assemble import Assembler, Limits
    from treelit.builders.base import make_tree_builder
    from treelit.builders.checks import check_limits
    from treelit.data.records import DataError, iter_file
    from treelit.data.tokenizers import qwen_tokenizer_dir

    conv = [{"role": "user", "content": "Paris, please."}, {"role": "assistant", "content": "Booked."}]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"id": "c0", "messages": conv}) + "\n")
    builder = make_tree_builder("chat", tokenizer_path=qwen_tokenizer_dir())
    asm = Assembler(builder, limits=Limits(vocab_size=512))
    with pytest.raises(DataError) as err:
        for rec in iter_file(str(path)):
            asm.add(rec)
        asm.flush()
    msg = str(err.value)
    assert f"{path}:1" in msg and "outside the model's vocabulary (size 512)" in msg
    assert f"a vocabulary of {len(builder.tok):,} ids" in msg and "model=qwen2_5_tiny_qwen_vocab" in msg
    assert "model.hf_checkpoint=DIR" in msg and "\n" not in msg

    class Huge:  # a tokenizer larger than the Qwen preset's vocabulary: only your checkpoint fits
        def __len__(self):
            return 200_000

    with pytest.raises(DataError) as err:
        check_limits("f:1", [{"input_ids": [1, 199_999], "_where": "messages"}], Limits(vocab_size=512), Huge())
    assert "a vocabulary of 200,000 ids" in str(err.value) and "qwen2_5_tiny_qwen_vocab" not in str(err.value)
    with pytest.raises(DataError) as err:  # token data: no tokenizer to speak of
        check_limits("f:1", [{"input_ids": [1, 600], "_where": "branches[0]"}], Limits(vocab_size=512))
    assert str(err.value).endswith("outside the model's vocabulary (size 512)")


# config typos: one line with the closest names -------------------------------------------------


@pytest.mark.parametrize("args,expected", [
    (["model=qwen3_tinyy"], "error: model=qwen3_tinyy: no such option (no config model/qwen3_tinyy); "
                            "did you mean qwen3_tiny"),
    (["trainer.max_step=5"], "error: trainer.max_step: no such option; did you mean trainer.max_steps"),
    (["seeed=1"], "error: seeed: no such option; did you mean seed?"),
    (["model.config.zzz=1"], "error: model.config.zzz: no such option; the options under model.config are "
                             "embed_dim, intermediate_dim,"),
    (["trainer.max_steps=[1"], "error: cannot parse 'trainer.max_steps=[1': "),
], ids=["group-option", "key", "root-key", "no-close-key", "syntax"])
def test_a_config_typo_is_one_error_line_with_the_closest_names(args, expected, tmp_path, cli_main, capsys,
                                                                 monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    status = cli_main(*args, "logger=none", f"output_dir={tmp_path / 'out'}")
    out, err = capsys.readouterr()
    assert status == 1
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(expected), err
    for dump in ("Available options", "Config search path", "To append to your config", "full_key", "Traceback"):
        assert dump not in out + err, (dump, err)
    assert err.strip().splitlines() == errors  # the whole of stderr is the one error line
    import os

    assert os.environ.get("HYDRA_FULL_ERROR", "0") == "0" and "HYDRA_FULL_ERROR_USER" not in os.environ


def test_a_key_the_target_does_not_take_names_its_parameters(tmp_path, cli_main, capsys):
    status = cli_main("+trainer.max_step=5", *TINY, "data.max_trees=2", "logger=none", f"output_dir={tmp_path / 'o'}")
    err = capsys.readouterr().err
    assert status == 1 and "Traceback" not in err
    assert "error: trainer.max_step: lightning.pytorch.trainer.trainer.Trainer takes no option 'max_step'; " \
           "did you mean max_steps" in err


def test_hydra_full_error_raises_hydras_exception(tmp_path, cli_main, monkeypatch):
    from hydra.errors import MissingConfigException

    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(MissingConfigException):
        cli_main("model=qwen3_tinyy", "logger=none", f"output_dir={tmp_path / 'out'}")
    import os

    assert os.environ["HYDRA_FULL_ERROR"] == "1"


def test_non_hydra_errors_are_not_hydra_messages():
    assert hydra_error_message(ValueError("x")) is None


# treelit list: every kind selected as the README says -------------------------------------------


def _sections(out: str):
    sections, cur = {}, None
    for line in out.splitlines():
        if not line.startswith(" "):
            cur = line.split()[0]
            sections[cur] = line
        else:
            sections[cur] += "\n" + line
    return sections


def test_list_selects_every_kind_and_group_as_the_readme_table_does(capsys):
    from treelit.cli.config import compose
    from treelit.cli.main import main

    assert main(["list"]) == 0
    sections = _sections(capsys.readouterr().out)
    src = sections["data_source"]
    assert "library use" not in src
    assert "files                      treelit  [data=stream]" in src
    assert "hf_dataset                 treelit  [data=hf_dataset]" in src
    for option, name in (("stream", "files"), ("hf_dataset", "hf_dataset")):
        assert compose([f"data={option}"]).data.source.name == name
    readme = (REPO / "docs" / "training.md").read_text()  # the guide's table of config groups
    table = readme.split("| group | options (built-in) | what it chooses |", 1)[1].split("\n\n", 1)[0]
    table = [line for line in table.splitlines() if re.match(r"\| `\w+` \| ", line)]
    groups = 0
    for row in table:
        group, options = re.match(r"\| `(\w+)` \| (.*?) \|", row).groups()
        assert group in sections, f"`treelit list` does not show the guide's group {group}"
        assert sections[group].startswith(f"{group}  (select with {group}=NAME)"), sections[group][:200]
        for name in re.findall(r"`(\w+)`", options):
            assert re.search(rf"\b{name}\b", sections[group]), (group, name)
        groups += 1
    assert groups >= 12
    # and the other way: every config group `treelit list` shows has its row, every option of it is named
    rows = {re.match(r"\| `(\w+)` \|", row).group(1): row for row in table}
    for group, text in sections.items():
        listed = re.search(r"config (?:options|presets): (.*)", text)
        if listed is None or group not in sections or "select with " + group + "=NAME" not in text:
            continue
        assert group in rows, f"the guide's table of config groups lacks {group}"
        for name in listed.group(1).split(", "):
            assert f"`{name}`" in rows[group], (group, name)


def test_a_default_run_without_triton_prints_no_triton_warning(tmp_path):
    """A plain ``pip install -e .`` has no triton; torchao then warns on import. treelit-train's
    console (and train.log) stay free of it."""
    import subprocess

    code = ("import sys; sys.modules['triton'] = None\n"
            "from treelit.cli.train import main\n"
            f"sys.argv = ['treelit-train', 'trainer.max_steps=1', 'logger=none', 'output_dir={tmp_path / 'out'}']\n"
            "main()\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "done: 1 step " in res.stdout
    assert "triton" not in (res.stdout + res.stderr).lower()
    assert "triton" not in (tmp_path / "out" / "train.log").read_text().lower()


def test_an_online_rl_summary_shows_the_sampler_kl_and_says_why_the_first_update_kl_is_zero():
    from treelit.cli.summary import format_summary

    first = {"step": 1, "reward_mean": 0.5, "approx_kl": 0.0, "clip_frac": 0.0, "behavior/kl": 0.0072}
    last = {"step": 30, "reward_mean": 0.9, "approx_kl": 0.0, "clip_frac": 0.0, "behavior/kl": 0.0001}
    s = {"global_step": 30, "wall_seconds": 60.0, "rl": {"first": first, "last": last}, "config": "c.yaml"}
    policy = next(line for line in format_summary(s).splitlines() if line.startswith("  policy"))
    assert policy.startswith("  policy      KL sampler to trainer 0.0072 -> 0.0001, KL to rollout policy 0 -> 0, "
                             "clip fraction 0 -> 0 (step 1 -> 30); ")
    assert "0 is expected" in policy
    last.update(approx_kl=0.01, clip_frac=0.05)
    assert "0 is expected" not in format_summary(s)


def test_a_summary_whose_first_step_is_its_last_shows_each_value_once():
    """Two updates of one step batch (ppo_epochs=2, max_steps=2): the first recorded step is the
    last. The summary once compared "(step 2 -> 2)" and a GSPO loss "-0.000 -> -0.000"."""
    from treelit.cli.summary import format_summary

    one = {"step": 2, "reward_mean": 0.4667, "seq_ratio_mean": 0.9951}
    s = {"global_step": 2, "wall_seconds": 9.0, "rl": {"first": dict(one), "last": dict(one)},
         "reward_margin": {"first": {"step": 0, "margin": -0.01, "logp_high": -6.2, "logp_low": -6.2},
                           "last": {"step": 2, "margin": 0.08, "logp_high": -6.24, "logp_low": -6.32}},
         "config": "c.yaml"}
    out = format_summary(s)
    assert "  reward      mean 0.467 over the step's branches (step 2)" in out
    assert "  policy      sequence ratio 0.9951 (step 2)" in out
    assert "  margin      -0.01 -> 0.08 nats (step 0 -> 2)" in out
    assert "2 -> 2" not in out and "-0.000" not in out
    sft = {"global_step": 2, "wall_seconds": 4.0, "loss": {"first": [2, -2.838e-09], "last": [2, -2.838e-09]},
           "config": "c.yaml"}
    assert format_summary(sft).splitlines()[0] == "done: 2 steps in 4s; loss -2.8e-09 (step 2)"


def test_a_gspo_step_is_recorded_as_an_rl_step():
    """GSPO logs its sequence ratio, not a token clip fraction: its steps are RL steps, so the
    summary has its reward line."""
    from treelit.lightning.callbacks import StepMetrics

    batch = types.SimpleNamespace(micro_batches=[types.SimpleNamespace(branch_fields={"reward": [1.0, 0.0, None]})])
    trainer = types.SimpleNamespace(callback_metrics={"seq_ratio_mean": 0.99, "loss": -2e-9}, global_step=2,
                                    max_steps=2, log_every_n_steps=1)
    cb = StepMetrics()
    cb.on_train_batch_end(trainer, None, {"loss": -2e-9}, batch, 0)
    assert cb.rl_first == cb.rl_last == {"step": 2, "reward_mean": 0.5, "seq_ratio_mean": 0.99}


def test_a_resumed_run_says_how_many_steps_its_time_covers():
    from treelit.cli.console import NOISE
    from treelit.cli.summary import format_summary

    s = {"global_step": 320, "wall_seconds": 26.0, "resumed_from": {"checkpoint": "out/last.ckpt", "step": 300},
         "loss": {"first": [301, 5.0], "last": [320, 4.9]}, "config": "c.yaml"}
    assert format_summary(s).splitlines()[0] == ("done: 320 steps (20 in this run, from step 300, in 26s); "
                                                 "loss 5.000 (step 301) -> 4.900 (step 320)")
    # Lightning's restore lines stay in train.log: the summary's "resumed" row says it
    assert any(n in "Restoring states from the checkpoint path at out/last.ckpt" for n in NOISE)
    assert any(n in "Restored all states from the checkpoint at out/last.ckpt" for n in NOISE)


@pytest.mark.parametrize("argv", [["bogus"], ["stats"], ["stats", "a", "--group-kee", "x"]])
def test_a_usage_error_of_treelit_is_one_line(argv, capsys):
    from treelit.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    out, err = capsys.readouterr()
    assert info.value.code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("treelit") and ": error: " in lines[0], err


def test_a_usage_error_of_treelit_rollout_is_one_line(capsys):
    from treelit.cli.rollout import main

    with pytest.raises(SystemExit) as info:
        main(["--n", "8"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("treelit-rollout: error: the following arguments are required"), err


def test_the_data_line_counts_one_skipped_record_in_the_singular():
    from treelit.cli.summary import data_line

    d = {"trees": 2, "branches": 5, "tree_tokens": 40, "flat_tokens": 90, "por": 0.56, "records_skipped": 1}
    assert data_line(d).endswith("; 1 record skipped")
    assert data_line(dict(d, records_skipped=3)).endswith("; 3 records skipped")
