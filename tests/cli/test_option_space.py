"""The option space, walked from generated combinations: every combination either passes
validation or is refused in one line naming one of its bad options, and the test's own judge
(written from the rules the docs state, not from ``treelit.cli.option_checks``) agrees on which.

Four generated sets: the full product of the process axes (strategy x devices x nodes x replicate
degree x context-parallel degree), an all-pairs cover of every axis (each pair of values of any two
axes meets in at least one combination), an all-pairs cover of the values this machine can train
with, and an all-pairs cover of the model axes over values otherwise good. The model axes: a dense
or a MoE preset, the MoE routing mode (a typo among them), and ``model.vision=true`` on a
vision-language checkpoint (its config.json only: nothing is loaded). Every refusal's quotes
balance. Validation only (no model, no data): the default suite. A sample of the passing combinations trains one step in the slow set - a
combination that passes validation and fails later is what that test exists to catch."""

from __future__ import annotations

import copy
import functools
import itertools
import json
import random
import subprocess
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set

import pytest
from omegaconf import OmegaConf

from cli_helpers import TINY, cli_cmd, cli_env, quotes_balance
from treelit.cli.config import CONF_DIR, ConfigError, compose, validate_config

PROCESS_AXES = {
    "trainer": ["cpu", "ddp_cpu", "fsdp2_cpu"],
    "devices": [1, 2, 3, 4, 0],
    "num_nodes": [1, 2],
    "replicate": [1, 2, 3],
    "cp": [1, 2, 3],
}
AXES = {
    **PROCESS_AXES,
    "partition": ["none", "free-null", "free-64", "free-0"],
    "critic": ["none", "shared"],
    "objective": ["sft", "grpo", "ppo", "dpo"],
    "lora": [None, 4],
    "lora_dropout": [0.0, 0.1],
    "mode": ["tree", "linear"],
    "grad_clip": [None, 0.0, 1.0, -1.0],
    "lr": [3e-3, 1e39, -1.0],
    "reference": ["data", "base", "initial"],
    "model": ["tiny", "moe"],
    "routing": ["live", "replay", "replayed"],
    "vision": [False, True],
    "verify_every": [0, 2],
}
DEFAULTS = {name: values[0] for name, values in AXES.items()}
# the values this machine can train with (one node, two processes, a budget the data's paths fit)
TRAIN_AXES = {
    "trainer": ["cpu", "ddp_cpu", "fsdp2_cpu"], "devices": [1, 2], "num_nodes": [1], "replicate": [1, 2],
    "cp": [1, 2], "partition": ["none", "free-null", "free-512"], "critic": ["none", "shared"],
    "objective": ["sft", "grpo", "ppo"], "lora": [None, 4], "lora_dropout": [0.0], "mode": ["tree", "linear"],
    "grad_clip": [None, 0.0, 1.0], "lr": [3e-3], "reference": ["data", "initial"],
}

# the model's axes over values that are otherwise good: the routing and vision judgements are the ones met
MODEL_AXES = {
    "trainer": ["cpu", "ddp_cpu", "fsdp2_cpu"], "devices": [1, 2], "cp": [1, 2], "mode": ["tree", "linear"],
    "partition": ["none", "free-null"], "verify_every": [0, 2], "model": ["tiny", "moe"],
    "routing": ["live", "replay", "replayed"], "vision": [False, True],
}


def all_pairs(axes: Dict[str, Sequence], seed: int = 0) -> List[Dict]:
    """A deterministic all-pairs cover: greedy, each row the best of 40 random candidates that
    all contain the first pair not yet covered."""
    names = list(axes)
    pairs = list(itertools.combinations(range(len(names)), 2))
    left = {(i, a, j, b) for i, j in pairs for a in range(len(axes[names[i]])) for b in range(len(axes[names[j]]))}
    rng = random.Random(seed)
    rows = []
    while left:
        i, a, j, b = min(left)
        best, best_score = None, -1
        for _ in range(40):
            row = [rng.randrange(len(axes[n])) for n in names]
            row[i], row[j] = a, b
            score = sum((p, row[p], q, row[q]) in left for p, q in pairs)
            if score > best_score:
                best, best_score = row, score
        left -= {(p, best[p], q, best[q]) for p, q in pairs}
        rows.append({n: axes[n][k] for n, k in zip(names, best)})
    return rows


def train_pairs() -> List[Dict]:
    """The all-pairs cover of the values this machine can train with (the model axes at their defaults)."""
    return [dict(DEFAULTS, **c) for c in all_pairs(TRAIN_AXES, seed=1)]


def combinations() -> List[Dict]:
    product = [dict(DEFAULTS, **dict(zip(PROCESS_AXES, values)))
               for values in itertools.product(*PROCESS_AXES.values())]
    model = [dict(DEFAULTS, **c) for c in all_pairs(MODEL_AXES, seed=2)]
    return product + all_pairs(AXES) + train_pairs() + model


def judge(c: Dict) -> Set[str]:
    """The options a combination gets wrong (empty: it should pass), from the documented rules."""
    bad: Set[str] = set()
    world = c["devices"] * c["num_nodes"]
    if c["devices"] < 1:
        bad.add("trainer.devices")
    elif c["trainer"] == "ddp_cpu" and c["cp"] != 1:
        bad.add("context_parallel_degree")
    elif c["trainer"] == "fsdp2_cpu":
        if world % c["replicate"]:
            bad.add("replicate_degree")
        elif (world // c["replicate"]) % c["cp"]:
            bad.add("context_parallel_degree")
    fsdp = c["trainer"] == "fsdp2_cpu"
    if fsdp and c["mode"] == "linear":
        bad.add("mode=linear")
    if c["critic"] != "none":
        if c["objective"] != "ppo":
            bad.add("critic=")
        elif (fsdp and c["partition"] != "none") or (c["trainer"] != "cpu" and c["cp"] > 1):
            bad.add("critic=")
    if c["partition"] == "free-0":
        bad.add("partition.budget_tokens")
    if c["lora"] and c["lora_dropout"] and c["mode"] == "tree":
        bad.add("model.lora.dropout")
    if c["reference"] == "base" and c["objective"] != "sft" and not c["lora"]:
        bad.add("objective.reference=base")
    if c["grad_clip"] is not None and c["grad_clip"] < 0:
        bad.add("grad_clip")
    if c["lr"] < 0 or c["lr"] > 3.4e38:
        bad.add("optimizer.lr")
    if fsdp and c["verify_every"]:
        bad.add("verify_every")
    # MoE routing: live or replay; replay needs a model with MoE layers (the vision checkpoint has none)
    if c["routing"] not in ("live", "replay"):
        bad.add("model.moe.routing")
    elif c["routing"] == "replay" and (c["vision"] or c["model"] != "moe"):
        bad.add("model.moe.routing")
    # (the vision tower runs everywhere: one process, DDP, FSDP2, HSDP, context parallelism, the
    # per-branch baseline and its verification; nothing is refused for model.vision=true alone)
    return bad


_COMPOSED: Dict[tuple, object] = {}


@functools.lru_cache(maxsize=1)
def vision_checkpoint() -> str:
    """A folder with the config.json of a vision-language checkpoint (no weights: nothing is loaded)."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="treelit-vl-"))
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {"depth": 1}}))
    return str(folder)


def config(c: Dict):
    """The composed config of a combination: the trainer through Hydra (cached); the partition,
    critic and objective groups (plain files, no defaults lists) put in as their files say; the
    values set after."""
    if c["trainer"] not in _COMPOSED:
        _COMPOSED[c["trainer"]] = compose([f"trainer={c['trainer']}"])
    cfg = copy.deepcopy(_COMPOSED[c["trainer"]])
    if c["vision"]:  # model=hf_auto on a vision checkpoint
        cfg.model = OmegaConf.load(Path(CONF_DIR) / "model" / "hf_auto.yaml")
        cfg.model.hf_checkpoint, cfg.model.vision = vision_checkpoint(), True
    elif c["model"] == "moe":
        cfg.model = OmegaConf.load(Path(CONF_DIR) / "model" / "qwen3_moe_tiny.yaml")
    for group, name in (("partition", "none" if c["partition"] == "none" else "redundancy_free"),
                        ("critic", c["critic"]), ("objective", c["objective"])):
        cfg[group] = OmegaConf.load(Path(CONF_DIR) / group / f"{name}.yaml")
    values = {"trainer.devices": c["devices"], "trainer.num_nodes": c["num_nodes"], "mode": c["mode"],
              "grad_clip": c["grad_clip"], "optimizer.lr": c["lr"], "model.lora.rank": c["lora"],
              "model.lora.dropout": c["lora_dropout"], "model.moe.routing": c["routing"],
              "verify_every": c["verify_every"]}
    if c["trainer"] != "cpu":
        values["trainer.strategy.context_parallel_degree"] = c["cp"]
    if c["trainer"] == "fsdp2_cpu":
        values["trainer.strategy.replicate_degree"] = c["replicate"]
    if c["partition"] != "none":
        budget = c["partition"].split("-")[1]
        values["partition.budget_tokens"] = None if budget == "null" else int(budget)
    if c["objective"] != "sft":
        values["objective.reference"] = c["reference"]
    if c["critic"] == "separate":
        values["critic.model"] = "policy"
    for key, value in values.items():
        OmegaConf.update(cfg, key, value, force_add=False)
    return cfg


def verdict(c: Dict) -> Optional[str]:
    try:
        validate_config(config(c))
    except (ConfigError, KeyError) as exc:
        return str(exc.args[0] if isinstance(exc, KeyError) else exc)
    return None


def _name(c: Dict) -> str:
    return " ".join(f"{k}={v}" for k, v in c.items() if v != DEFAULTS[k]) or "defaults"


def test_every_combination_passes_or_is_refused_in_one_line_naming_a_bad_option():
    combos = combinations()
    assert any(c["vision"] for c in combos) and any(c["routing"] == "replay" and c["model"] == "moe" for c in combos)
    assert len(combos) >= 300  # the product of the process axes (270) and the all-pairs covers
    wrong = []
    for c in combos:
        msg, bad = verdict(c), judge(c)
        if msg is None and bad:
            wrong.append(f"{_name(c)}: passed validation, but {sorted(bad)} is wrong")
        elif msg is not None and not bad:
            wrong.append(f"{_name(c)}: refused ({msg}), but nothing is wrong")
        elif msg is not None and ("\n" in msg or not any(b in msg for b in bad)):
            wrong.append(f"{_name(c)}: the refusal names none of {sorted(bad)} in one line: {msg!r}")
        elif msg is not None and not quotes_balance(msg):
            wrong.append(f"{_name(c)}: the refusal's quotes do not balance: {msg!r}")
    assert not wrong, f"{len(wrong)} of {len(combos)}:\n" + "\n".join(wrong[:20])


def test_all_pairs_cover_every_pair_of_values():
    rows = all_pairs(AXES)
    for (p, vp), (q, vq) in itertools.combinations(AXES.items(), 2):
        for a, b in itertools.product(vp, vq):
            assert any(r[p] == a and r[q] == b for r in rows), (p, a, q, b)


# the slow set: a sample of the passing combinations trains one step --------------------------------

def _data(c: Dict) -> List[str]:
    if c["objective"] == "sft":
        return []
    adv = "null" if c["critic"] != "none" else "grpo"
    return ["data=synthetic_rollouts", "data.max_trees=8", "tree_builder=groups", f"tree_builder.advantage={adv}"]


def _overrides(c: Dict) -> List[str]:
    out = [f"trainer={c['trainer']}", f"trainer.devices={c['devices']}", f"critic={c['critic']}",
           f"objective={c['objective']}", f"mode={c['mode']}", f"optimizer.lr={c['lr']}",
           f"grad_clip={'null' if c['grad_clip'] is None else c['grad_clip']}",
           f"partition={'none' if c['partition'] == 'none' else 'redundancy_free'}"]
    if c["partition"] != "none":
        out.append(f"partition.budget_tokens={c['partition'].split('-')[1]}")
    if c["trainer"] != "cpu":
        out.append(f"trainer.strategy.context_parallel_degree={c['cp']}")
    if c["trainer"] == "fsdp2_cpu":
        out.append(f"trainer.strategy.replicate_degree={c['replicate']}")
    if c["lora"]:
        out += [f"model.lora.rank={c['lora']}", f"model.lora.dropout={c['lora_dropout']}"]
    if c["objective"] != "sft":
        out.append(f"objective.reference={c['reference']}")
    return out + _data(c)


@functools.lru_cache(maxsize=1)
def training_sample(n: int = 8) -> List[Dict]:
    """Passing combinations of the values this machine can train with (one node, at most two
    processes, no DPO: no bundled preference pairs), spread over strategies, partitioning, LoRA,
    critic and CP."""
    ok = [c for c in train_pairs() if verdict(c) is None]
    picked, seen = [], set()
    for c in ok:
        key = (c["trainer"], c["cp"] > 1, c["partition"] != "none", bool(c["lora"]), c["critic"])
        if key not in seen:
            seen.add(key)
            picked.append(c)
    return picked[:n]


@pytest.mark.slow
@pytest.mark.parametrize("index", range(8))
def test_a_passing_combination_trains_a_step(index, tmp_path):
    sample = training_sample()  # (chosen when the test runs: collecting the default suite validates nothing)
    if index >= len(sample):
        pytest.skip(f"the sample has {len(sample)} combinations")
    combo = sample[index]
    print(_name(combo))
    out = tmp_path / "run"
    res = subprocess.run(cli_cmd(*TINY, "logger=none", "trainer.max_steps=1", f"output_dir={out}",
                                 *_overrides(combo)),
                         cwd=str(tmp_path), env=cli_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"{_name(combo)}: {res.stderr[-3000:]}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["global_step"] == 1 and summary["metrics"]["loss"] != 0.0, summary
