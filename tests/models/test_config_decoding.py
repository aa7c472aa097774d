"""config.json is read as the installed transformers reads it: non-finite floats written as
``{"__float__": "Infinity"}`` (transformers 5.x; fla's default Mamba2 ``dt_limit``) decode to floats.

Each supported family's default config is saved by the installed transformers / fla and read
back through treelit's reader, which must give exactly what transformers' own reader gives;
the native and fla families are then translated, and a tiny fla Mamba2 with the default
``dt_limit`` loads as a model.
"""

from __future__ import annotations

import math

import pytest
import torch

import treelit
from treelit.models.config import decode_special_floats, parse_config_json
from treelit.models.hf import CheckpointError, config_from_hf, read_config_json

transformers = pytest.importorskip("transformers")

NATIVE = ["llama", "qwen2", "mistral", "qwen3", "qwen3_moe"]
ADAPTER = ["llama", "qwen2", "qwen3", "qwen3_moe", "gemma3_text", "phi3", "olmo2"]  # test_hf_adapter.FAMILIES
FLA = ["gated_deltanet", "mamba2"]


def _fla_config(model_type, **kwargs):
    fla_models = pytest.importorskip("fla.models")
    cls = {"gated_deltanet": fla_models.GatedDeltaNetConfig, "mamba2": fla_models.Mamba2Config}[model_type]
    return cls(**kwargs)


def _default_config(model_type):
    if model_type in FLA:
        return _fla_config(model_type)
    return transformers.AutoConfig.for_model(model_type)


def _same(a, b):
    """Equal, NaN equal to NaN, floats and their types compared exactly."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return type(a) is type(b) and a == b


CASES = [
    {"__float__": "Infinity"},
    {"__float__": "-Infinity"},
    {"__float__": "NaN"},
    {"__float__": "inf"},  # not a tag transformers knows: kept
    {"__float__": 1.0},  # not a string: kept
    {"__float__": "Infinity", "other": 1},  # more than the tag: a plain dict
    {"dt_limit": [0.0, {"__float__": "Infinity"}], "nested": {"a": [[{"__float__": "-Infinity"}]], "b": "x"}},
    [1, "Infinity", None, True, {"k": {"__float__": "NaN"}}],
    "Infinity",
    3.5,
]


@pytest.mark.parametrize("obj", CASES, ids=range(len(CASES)))
def test_decoding_rules_are_transformers_rules(obj):
    theirs = getattr(transformers.PretrainedConfig, "_decode_special_floats", None)
    if theirs is None:  # transformers 4.x writes bare Infinity, which json.loads reads
        pytest.skip("the installed transformers has no special-float tags")
    assert _same(decode_special_floats(obj), theirs(obj))


def test_mamba2_default_is_tagged_and_decodes():
    """The issue's case: the default dt_limit as the installed transformers writes it."""
    text = _default_config("mamba2").to_json_string()
    got = parse_config_json(text)
    assert got["dt_limit"] == [0.0, math.inf]


@pytest.mark.parametrize("model_type", sorted(set(NATIVE + ADAPTER + FLA)))
def test_default_config_reads_as_transformers_reads_it(model_type, tmp_path):
    _default_config(model_type).save_pretrained(tmp_path)
    ours, cfg_file = read_config_json(tmp_path)
    theirs = transformers.PretrainedConfig._dict_from_json_file(cfg_file)
    assert _same(ours, theirs)
    assert "__float__" not in repr(ours)


@pytest.mark.parametrize("model_type", NATIVE + FLA)
def test_default_config_translates(model_type, tmp_path):
    _default_config(model_type).save_pretrained(tmp_path)
    cfg, cfg_file = read_config_json(tmp_path)
    config = config_from_hf(cfg, where=str(cfg_file))
    assert config.vocab_size == cfg["vocab_size"] and config.num_layers == cfg["num_hidden_layers"]
    if model_type == "mamba2":
        assert config.recurrent["mamba2"]["dt_limit"] == (0.0, math.inf)


def test_config_from_hf_decodes_a_tagged_dict_itself():
    cfg = _default_config("mamba2").to_dict()
    cfg["dt_limit"] = [0.0, {"__float__": "Infinity"}]
    assert config_from_hf(cfg).recurrent["mamba2"]["dt_limit"] == (0.0, math.inf)


def test_bad_dt_limit_is_a_checkpoint_error_naming_the_key():
    cfg = _default_config("mamba2").to_dict()
    cfg["dt_limit"] = [0.0, {"__float__": "lots"}]
    with pytest.raises(CheckpointError, match="dt_limit"):
        config_from_hf(cfg)


def test_fla_mamba2_checkpoint_with_default_dt_limit_loads(tmp_path):
    """A tiny fla Mamba2 saved by fla (default dt_limit = (0, inf)) loads with its weights, and
    treelit's own save of it loads back in fla with the same dt_limit."""
    fla_models = pytest.importorskip("fla.models")
    cfg = _fla_config("mamba2", vocab_size=16, hidden_size=32, num_hidden_layers=2, max_position_embeddings=64,
                      head_dim=16, num_heads=4, state_size=8, n_groups=2, expand=2)
    assert cfg.dt_limit[1] == math.inf
    torch.manual_seed(0)
    fla_models.Mamba2ForCausalLM(cfg).save_pretrained(tmp_path / "fla")
    assert "__float__" in (tmp_path / "fla" / "config.json").read_text()
    model = treelit.load_hf_checkpoint(tmp_path / "fla")
    assert model.config.recurrent["mamba2"]["dt_limit"] == (0.0, math.inf)
    treelit.save_hf_checkpoint(model, tmp_path / "ours")
    back = fla_models.Mamba2Config.from_pretrained(tmp_path / "ours")
    assert tuple(back.dt_limit) == (0.0, math.inf)
    again = treelit.load_hf_checkpoint(tmp_path / "ours")
    for (k, a), (k2, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k


def test_fla_gated_deltanet_checkpoint_saved_by_fla_loads(tmp_path):
    """The other fla family, saved by fla itself with the installed transformers, loads with its weights."""
    fla_models = pytest.importorskip("fla.models")
    cfg = _fla_config("gated_deltanet", vocab_size=16, hidden_size=32, num_hidden_layers=2, max_position_embeddings=64,
                      head_dim=8, num_heads=2, num_v_heads=4, expand_v=2.0)  # fla's attention layers need flash-attn
    torch.manual_seed(0)
    theirs = fla_models.GatedDeltaNetForCausalLM(cfg)
    theirs.save_pretrained(tmp_path / "fla")
    model = treelit.load_hf_checkpoint(tmp_path / "fla")
    assert model.config.layer_types == ["gdn", "gdn"]
    from treelit.models.hf_recurrent import tune_to_hf_recurrent

    back = tune_to_hf_recurrent(model.state_dict(), model.config)
    sd = theirs.state_dict()
    assert set(back) == set(sd)
    for k, v in back.items():
        assert torch.equal(v, sd[k]), k
