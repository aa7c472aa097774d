"""Every value the configuration reference documents is accepted: generated from the options'
YAML comments (the reference's single source, ``treelit.cli.config_reference``), each enumerated
choice (``a | b | c``) and ``null`` where a comment names it is set on its own and validated.
It passes, or - only where the reference itself states the condition (a CUDA device, LoRA, a
setting it needs) - it is refused in one line naming the option and that condition.
A run-level value that passes also builds the training module, where those values are used
(no data, no step). The default suite."""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import yaml
from omegaconf import OmegaConf

from treelit.cli import config_reference as ref
from treelit.cli.config import ConfigError, compose, validate_config

ROOT = "(root: train.yaml)"
PAGE = (Path(__file__).resolve().parents[2] / "docs" / "config-reference.md").read_text()
# group -> the selections its options need to be judged on their own (a critic trains objective=ppo)
CONTEXT = {"critic": ["objective=ppo"]}
# (group, file) -> what choosing that file needs beside it (critic=separate: its own model)
FILE_CONTEXT = {("critic", "separate"): ["critic.model=policy"]}
# enumerations in a comment that are not values of the option itself (a hook's preset)
NOT_VALUES = {("publish", "hooks")}
# (option as set, value) -> what the refusal and the group's section of the reference both say
DOCUMENTED_REFUSALS = {
    ("attention", "flex"): "CUDA",
    ("ssm", "fla"): "CUDA",
    ("trainer.accelerator", "gpu"): "CUDA",
    ("objective.reference", "base"): "LoRA",
    ("objective.behavior_correction", "tis"): "old_logprobs=rollout",
    ("objective.behavior_correction", "decoupled"): "old_logprobs=rollout",
    ("model.moe.routing", "replay"): "mixture-of-experts model",
    ("objective.behavior_correction", "mis"): "old_logprobs=rollout",
    ("objective.behavior_is_level", "sequence"): "behavior_correction",
    ("objective.behavior_is_level", "geometric"): "behavior_correction",
}
# a group file whose options are judged on a machine it may not fit: what the refusal says (a GPU trainer)
DOCUMENTED_SELECTIONS = {"trainer=gpu": "CUDA", "trainer=ddp": "CUDA", "trainer=fsdp2": "CUDA"}


def enumerated(description: str) -> List[str]:
    """The choices of ``a | b (why) | c: ...``: parenthesised asides dropped, the first choice
    the last word before the first bar, the others the first word after each bar."""
    text = description
    while re.search(r"\([^()]*\)", text):
        text = re.sub(r"\([^()]*\)", "", text)
    parts = text.split("|")
    if len(parts) < 2 or re.search(r"=\s*[\w.+-]+\s*$", parts[0]):  # (`critic=shared|separate`: a condition)
        return []
    word = r"[\w.+-]+"
    first = re.findall(word, parts[0])
    rest = [re.match(rf"\s*({word})", p) for p in parts[1:]]
    return ([first[-1]] if first else []) + [m.group(1) for m in rest if m]


def section(group: str) -> str:
    start = PAGE.index(f"## {group}\n")
    end = PAGE.find("\n## ", start + 1)
    return PAGE[start:end if end > 0 else None]


def documented_values() -> List[Tuple[str, str, str, List[str], str]]:
    """(group, option key, value, overrides that set it, its description) for every documented value."""
    defaults = {k: v for d in yaml.safe_load((ref.CONF / "train.yaml").read_text())["defaults"]
                if isinstance(d, dict) for k, v in d.items()}
    out = []
    for group, files in ref._groups().items():
        if group in ref.PRESET_GROUPS:
            continue
        for key, opt in ref._collect(files).items():
            if (group, key) in NOT_VALUES:
                continue
            values = enumerated(opt.description)
            if re.search(r"\bnull\b", opt.description):
                values.append("null")
            names = [f.stem for f in files]
            home = defaults.get(group) if defaults.get(group) in opt.values else next(iter(opt.values))
            for value in dict.fromkeys(values):
                if group == ROOT:
                    sets = [f"{key}={value}"]
                elif key == "name" and value in names:  # the group's selector: choose the file
                    sets = [f"{group}={value}"]
                elif key == "name":
                    continue  # (a plugin's name: not a file of the group)
                else:
                    pick = [] if home == defaults.get(group) else [f"{group}={home}"]
                    pick += FILE_CONTEXT.get((group, home), [])
                    sets = pick + [f"{group}.{key}={value}"]
                out.append((group, key, value, CONTEXT.get(group, []) + sets, opt.description))
    return out


VALUES = documented_values()
GROUPS = set(ref._groups())
_COMPOSED: Dict[tuple, object] = {}


@functools.lru_cache(maxsize=1)
def _tiny_model():
    from treelit.cli.train import build

    cfg = compose(["model.config.num_layers=1", "model.config.embed_dim=32", "model.config.intermediate_dim=64"])
    return build(cfg.model)


def config(overrides: List[str]):
    """``compose(overrides)``: the group selections through Hydra (cached), the values set after."""
    picks = tuple(o for o in overrides if o.split("=")[0] in GROUPS)
    if picks not in _COMPOSED:
        _COMPOSED[picks] = compose(list(picks))
    cfg = copy.deepcopy(_COMPOSED[picks])
    for o in overrides:
        if o not in picks:
            key, value = o.split("=", 1)
            OmegaConf.update(cfg, key, yaml.safe_load(value), force_add=False)
    return cfg


def test_the_reference_documents_enough_values_to_walk():
    assert len(VALUES) > 60, len(VALUES)
    seen = {(g, k, v) for g, k, v, _, _ in VALUES}
    for must in [(ROOT, "grad_clip", "null"), (ROOT, "mode", "linear"), ("attention", "name", "flex"),
                 ("objective", "reference", "base"), ("callbacks", "progress.plain", "true"),
                 ("trainer", "precision", "bf16-true"), ("model", "lora.init", "orthogonal")]:
        assert must in seen, must


@pytest.mark.parametrize("group,key,value,overrides,description", VALUES,
                         ids=[" ".join(v[3]) for v in VALUES])
def test_documented_value_validates_or_is_refused_as_documented(group, key, value, overrides, description):
    option = key if group == ROOT else (group if key == "name" else f"{group}.{key}")
    try:
        cfg = config(overrides)
        validate_config(cfg)
        if group == ROOT:  # the values the module takes: built as treelit-train builds it
            from treelit.cli.train import build, build_module

            build_module(cfg, _tiny_model(), build(cfg.objective))
    except (ConfigError, KeyError) as exc:
        msg = str(exc.args[0] if isinstance(exc, KeyError) else exc)
        why = DOCUMENTED_REFUSALS.get((option, value))
        chosen = next((o for o in overrides if o in DOCUMENTED_SELECTIONS), None)
        if why is None and chosen is not None:
            why, option, value = DOCUMENTED_SELECTIONS[chosen], group, chosen
        assert why is not None, f"{' '.join(overrides)}: a documented value is refused: {msg}"
        assert "\n" not in msg and why in msg, msg
        assert option.split(".")[-1] in msg or value in msg or group in msg, msg
        assert why in section("(root: train.yaml)" if group == ROOT else group), \
            f"the reference's {group} section does not say {why!r}"
