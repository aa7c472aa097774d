"""How the transformers adapter recognises kernel entry points (treelit.models.hf_kernels).

The first test reads the installed transformers' source for every kernel-hub name it declares and
fails on a name treelit has not classified: a new release that adds or renames an entry point is
caught here, not by a user (transformers 5.25 renamed the convolution's entry point and put the
Mamba scans behind new wrappers). The others pin the walk on small stand-in functions: wrappers
and transformers helpers are followed, an unknown or wrapper-without-entry-point kernel is refused
naming the kernel and the tested releases, attribute names are not globals, and a layer whose
rebound forward is dropped after loading refuses to run a tree.
"""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

import treelit
from treelit.models import hf_kernels
from treelit.models.hf_kernels import _plan, kernel_class
from treelit.utils.versions import TESTED

HUB_NAME = re.compile(r"use_kernel_(?:forward|func)_from_hub(?:_with_fallback)?\(\s*[\"']([A-Za-z0-9_]+)[\"']")


def declared_hub_names():
    root = Path(transformers.__file__).parent
    names = {}
    for f in root.rglob("*.py"):
        for name in HUB_NAME.findall(f.read_text(encoding="utf-8", errors="replace")):
            names.setdefault(name, f.relative_to(root).as_posix())
    return names


def test_every_kernel_name_transformers_declares_is_classified():
    names = declared_hub_names()
    # the scan itself works: the entry points the hybrid families call are among them
    assert {"chunk_gated_delta_rule", "causal_conv1d_fn", "mamba_chunk_scan_combined", "RMSNorm"} <= set(names)
    unknown = {n: where for n, where in names.items() if kernel_class(n) is None}
    assert not unknown, (f"transformers {transformers.__version__} declares kernel names treelit does not classify "
                         f"(add each to a table in treelit.models.hf_kernels, with a test): {unknown}")


def _fake(src: str, module: str, **globals_) -> dict:
    """Functions defined by ``src`` as if in module ``module`` (their globals: ``globals_``)."""
    ns = {"__name__": module, **globals_}
    exec(compile(src, f"<{module}>", "exec"), ns)
    return ns


def _entry(name: str, torch_fn):
    """A stand-in for transformers' ``use_kernel_func_from_hub_with_fallback(name, ...)``."""
    func_name = name

    def wrapped(*args, **kwargs):
        return (func_name, torch_fn(*args, **kwargs))

    wrapped.__wrapped__ = torch_fn
    return wrapped


def _layer(name: str, fn):
    """A stand-in for the ``kernels`` package's layer made of a function (``kernel_layer_name``;
    the function in its forward's closure cell ``func``)."""
    func = fn

    class Func(nn.Module):
        kernel_layer_name = name

        def forward(self, *args, **kwargs):
            return func(*args, **kwargs)

    return Func()


def _make(name, torch_fn):
    def tree(*args, **kwargs):
        return ("tree", name)

    return tree


def test_wrappers_and_helpers_are_followed_to_their_entry_points():
    conv = _entry("causal_conv1d_fn", lambda x: ("torch", x))
    # a helper without a hub name (transformers' code without the kernels package), and the same body as a
    # kernels-package layer (with it)
    helper = _fake("def causal_conv1d_forward(x):\n    return causal_conv1d_fn(x)\n", "transformers.models.fake",
                   causal_conv1d_fn=conv)["causal_conv1d_forward"]
    for called in (helper, _layer("causal_conv1d_forward", helper)):
        mixer = _fake("def forward(x):\n    return conv_forward(x)\n", "transformers.models.fake",
                      conv_forward=called)["forward"]
        plan = _plan(mixer, "FakeMixer", _make)
        assert not plan.refusals
        assert set(plan.replace) == {"conv_forward"}
        assert plan.kernels >= {"causal_conv1d_fn"}
        rebound = _rebound(mixer, plan)
        assert rebound(1) == ("tree", "causal_conv1d_fn")  # the convolution reached through the wrapper
        assert mixer(1) == ("causal_conv1d_fn", ("torch", 1))  # the original untouched


def _rebound(fn, plan):
    return types.FunctionType(fn.__code__, {**fn.__globals__, **plan.replace}, fn.__name__)


def test_a_wrapper_that_reaches_no_entry_point_is_refused_naming_versions():
    body = _fake("def scan(x):\n    return x.cumsum(0)\n", "transformers.models.fake")["scan"]
    mixer = _fake("def forward(x):\n    return mamba2_scan_forward(x)\n", "transformers.models.fake",
                  mamba2_scan_forward=_layer("mamba2_scan_forward", body))["forward"]
    plan = _plan(mixer, "FakeMixer", _make)
    assert len(plan.refusals) == 1
    msg = plan.refusals[0]
    assert "FakeMixer" in msg and "'mamba2_scan_forward'" in msg
    assert f"transformers {transformers.__version__}" in msg and TESTED["transformers"][-1] in msg


def test_an_unknown_kernel_is_refused_and_tokenwise_ones_are_left_alone():
    unknown = _entry("brand_new_scan", lambda x: x)
    norm = _layer("RMSNorm", lambda x: x)
    mixer = _fake("def forward(x):\n    return brand_new_scan(rms(x))\n", "transformers.models.fake",
                  brand_new_scan=unknown, rms=norm)["forward"]
    plan = _plan(mixer, "FakeMixer", _make)
    assert not plan.replace
    assert len(plan.refusals) == 1 and "'brand_new_scan'" in plan.refusals[0]
    assert "does not know" in plan.refusals[0]
    assert kernel_class("RMSNorm") == "tokenwise" and kernel_class("brand_new_scan") is None


def test_attribute_names_are_not_globals():
    """transformers.activations has a module-level ``silu`` (a hub layer named SiLU); SiLUActivation's
    ``nn.functional.silu`` is an attribute, not that global (5.25 refused Bamba / Falcon-H1 over it)."""
    from transformers.activations import SiLUActivation

    plan = _plan(hf_kernels._inner(SiLUActivation.forward), "SiLUActivation", _make)
    assert plan.replace == {} and plan.kernels == set() and plan.refusals == []


def test_loaded_hybrid_has_no_hub_kernels_and_refuses_a_lost_binding(tmp_path):
    from hf_oracle import random_hf_checkpoint
    from models.test_hf_hybrid import HYBRID

    model_type, cfg = HYBRID["qwen3_5"]
    random_hf_checkpoint(tmp_path, model_type, **cfg)
    model = treelit.load_hf_model(tmp_path, dtype=torch.float64)
    assert not getattr(model.hf, "use_kernels", False)
    layer = next(m for m in model.modules() if hasattr(m, "_treelit_forward"))
    assert {"causal_conv1d_fn", "chunk_gated_delta_rule"} <= layer._treelit_kernels
    batch = treelit.TokenTree.from_branches([[1, 2, 3], [1, 2, 4]]).to_batch()
    assert treelit.tree_loss(model, batch).item() > 0
    del vars(layer)["forward"]  # what kernelize does to a layer it takes over
    with pytest.raises(RuntimeError, match="no longer runs treelit's tree kernels"):
        treelit.tree_loss(model, batch)


def test_the_console_says_which_layers_run_through_the_tree_kernels(tmp_path):
    from hf_oracle import random_hf_checkpoint
    from models.test_hf_hybrid import HYBRID
    from treelit.cli.train import hybrid_line

    model_type, cfg = HYBRID["qwen3_5"]
    random_hf_checkpoint(tmp_path, model_type, **cfg)
    line = hybrid_line(treelit.load_hf_model(tmp_path), "torch")
    assert line == ("model: 1 recurrent layer(s) (Qwen3_5GatedDeltaNet) run through treelit's tree kernels "
                    "(causal_conv1d_fn, chunk_gated_delta_rule; ssm=torch): each segment starts from its parent "
                    "segment's state")
    assert hybrid_line(torch.nn.Linear(2, 2), "torch") == ""  # nothing bound: no line
