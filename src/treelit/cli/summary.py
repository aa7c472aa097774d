"""The end-of-run summary of ``treelit-train``: ``summary.json`` and a few printed lines.

What a user wants to see when a run ends: how long it took and whether the loss fell,
what the tree saved (tree vs flat tokens, POR, the speedup measured by
``verify_every`` when it ran), and where everything is - the checkpoint to resume from,
the exported model, the resolved config, the MLflow run and the command that opens the
MLflow UI on it.
"""

from __future__ import annotations

import os

from pathlib import Path
from typing import Any, Dict, List, Optional

__all__ = ["build_summary", "data_line", "format_summary"]


def _short(path: str) -> str:
    """``path`` relative to the working directory when it lies below it."""
    rel = os.path.relpath(os.path.abspath(path))
    return path if rel.startswith("..") else rel


def _duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


def data_line(d: Dict[str, Any]) -> str:
    """The data statistics printed before training (``data: ...``). Data read whole is
    counted whole; a stream (``data=stream``, ``hf_dataset``, ``rollouts``) is not read in
    advance: its counts are those of the first trees read, and say so."""
    counts = (f"{d['trees']:,} trees, {d['branches']:,} branches, {d['tree_tokens']:,} tree tokens "
              f"({d['flat_tokens']:,} flat, POR {d['por']:.2f})")
    n = d.get("records_skipped") or 0
    skipped = f"; {n:,} record{'s' if n != 1 else ''} skipped" if n else ""
    if not d.get("streamed"):
        return counts + skipped
    if not d["trees"]:
        return f"streamed, not counted in advance: nothing read yet{skipped}"
    return (f"streamed, not counted in advance; so far {d.get('records_read', 0):,} records read, "
            f"the first {counts}{skipped}")


def build_summary(
    *,
    out: Path,
    trainer: Any,
    data_stats: Dict[str, Any],
    wall_seconds: float,
    resume: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Collect the run's results from the trainer, its callbacks and loggers (JSON-ready;
    credentials in URIs redacted, see :mod:`treelit.utils.redact`)."""
    from lightning.pytorch.callbacks import ModelCheckpoint  # heavy (~3 s CPU): imported once a run has trained

    from treelit.lightning.callbacks import HFExport, RewardMargin, StepMetrics
    from treelit.lightning.mlflow_logger import TreeMLFlowLogger
    from treelit.utils.mlflow_store import ui_command
    from treelit.utils.redact import redact_config

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k not in ("step", "epoch")}  # axes
    s: Dict[str, Any] = {
        "output_dir": str(out),
        "global_step": int(trainer.global_step),
        "wall_seconds": round(float(wall_seconds), 1),
        "metrics": metrics,
        "data": data_stats,
        "config": str(out / "config.yaml"),
    }
    for cb in trainer.callbacks:
        if isinstance(cb, StepMetrics) and cb.last is not None:
            s["loss"] = {"first": list(cb.first), "last": list(cb.last)}
        if isinstance(cb, StepMetrics) and cb.rl_last:
            s["rl"] = {"first": dict(cb.rl_first), "last": dict(cb.rl_last)}
        elif isinstance(cb, RewardMargin) and cb.history:
            s["reward_margin"] = {"first": dict(cb.history[0]), "last": dict(cb.history[-1])}
        elif isinstance(cb, ModelCheckpoint) and cb.last_model_path:
            s["checkpoint"] = cb.last_model_path
        elif isinstance(cb, HFExport) and cb.saved is not None:
            lora = (cb.saved / "adapter_config.json").exists()
            s["export"] = {"path": str(cb.saved), "format": "lora" if lora else "treelit" if cb.native else "huggingface"}
            if getattr(cb, "merged", None):
                s["export"]["merged"] = str(cb.merged)
    verify = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("verify/")}
    if verify:
        s["verify"] = verify
    if resume:
        s["resumed_from"] = {"checkpoint": resume["path"], "step": resume.get("global_step")}
    for lg in trainer.loggers:
        if isinstance(lg, TreeMLFlowLogger) and lg.run_id:
            # only rank 0 opens the store: elsewhere lg.experiment is Lightning's no-op stand-in,
            # whose get_run returns None (the run's name is then unknown here)
            run = lg.experiment.get_run(lg.run_id)
            s["mlflow"] = {
                "run_id": lg.run_id,
                "run_name": getattr(getattr(run, "info", None), "run_name", None),
                "experiment": lg._experiment_name,
                "tracking_uri": lg.tracking_uri,
                "continued": lg.reopened,
                "ui": ui_command(lg.tracking_uri),
            }
    return redact_config(s)


def _num(x: float, digits: int = 3) -> str:
    """A loss or reward with ``digits`` decimals; one that would print as ``-0.000`` (a clipped
    policy loss near 0) in two significant figures instead."""
    return f"{x:.{digits}f}" if x == 0 or abs(x) >= 0.5 * 10 ** -digits else f"{x:.1e}"


def _pair(a: Dict[str, Any], b: Dict[str, Any], key: str, fmt) -> str:
    """``first -> last``, or the one value when the first step is the last."""
    return fmt(b[key]) if a["step"] == b["step"] else f"{fmt(a[key])} -> {fmt(b[key])}"


def _g4(x: float) -> str:
    return f"{x:.4g}"


def _span(a: Dict[str, Any], b: Dict[str, Any]) -> str:
    return f"(step {b['step']})" if a["step"] == b["step"] else f"(step {a['step']} -> {b['step']})"


def _rl_rows(s: Dict[str, Any], row: Any) -> None:
    """What an RL user reads, first step -> last: the mean reward of the step's branches, the
    reward margin (mean log-prob per token of high- minus low-reward branches), the KL to the
    reference / rollout policy, the clip fraction, GSPO's sequence ratio. A run whose first
    recorded step is its last (one step batch, several updates) shows that step's values once."""
    rl, margin = s.get("rl"), s.get("reward_margin")
    if rl:
        a, b = rl["first"], rl["last"]
        span = _span(a, b)
        if "reward_mean" in a and "reward_mean" in b:
            row("reward", f"mean {_pair(a, b, 'reward_mean', _num)} over the step's branches {span}")
        parts = [f"{label} {_pair(a, b, k, _g4)}" for k, label in
                 (("behavior/kl", "KL sampler to trainer"), ("kl_ref", "KL to reference"),
                  ("approx_kl", "KL to rollout policy"), ("clip_frac", "clip fraction"),
                  ("seq_ratio_mean", "sequence ratio"))
                 if k in a and k in b]
        if parts:
            still = all(not x.get(k) for x in (a, b) for k in ("approx_kl", "clip_frac") if k in x)
            why = ("; the KL to the rollout policy and the clip fraction are measured on each step's first update, "
                   "where the policy is still the one the step's old log-probs came from, so 0 is expected"
                   if still and ("approx_kl" in a or "clip_frac" in a) else "")
            row("policy", f"{', '.join(parts)} {span}{why}")
        if "critic/value_loss" in a and "critic/value_loss" in b:  # PPO with a value function
            a = {**a, "critic/explained_variance": a.get("critic/explained_variance", float("nan"))}
            b = {**b, "critic/explained_variance": b.get("critic/explained_variance", float("nan"))}
            row("critic", f"value loss {_pair(a, b, 'critic/value_loss', _g4)}, explained variance "
                          f"{_pair(a, b, 'critic/explained_variance', lambda x: f'{x:.3f}')}, values mean "
                          f"{_pair(a, b, 'critic/values_mean', lambda x: f'{x:.3f}')} against returns mean "
                          f"{_pair(a, b, 'critic/returns_mean', lambda x: f'{x:.3f}')} {span}")
    if margin:
        a, b = margin["first"], margin["last"]
        row("margin", f"{_pair(a, b, 'margin', lambda x: f'{x:.2f}')} nats {_span(a, b)}: mean "
                      f"log-prob per token of high- minus low-reward branches ({b['logp_high']:.2f} vs "
                      f"{b['logp_low']:.2f} at the end)")


def format_summary(s: Dict[str, Any]) -> str:
    """A few aligned lines for the console."""
    n = s["global_step"]
    head = f"done: {n} step{'s' if n != 1 else ''} in {_duration(s['wall_seconds'])}"
    if "resumed_from" in s and s["resumed_from"].get("step") is not None:  # the time is this run's steps only
        here = n - int(s["resumed_from"]["step"])
        head = (f"done: {n} step{'s' if n != 1 else ''} ({here} in this run, from step {s['resumed_from']['step']}, "
                f"in {_duration(s['wall_seconds'])})")
    if "loss" in s and "rl" not in s:  # a clipped policy loss starts near 0 and says little: the RL rows below
        (a, la), (b, lb) = s["loss"]["first"], s["loss"]["last"]
        head += (f"; loss {_num(lb)} (step {b})" if a == b else
                 f"; loss {_num(la)} (step {a}) -> {_num(lb)} (step {b})")
    lines: List[str] = [head]

    def row(key: str, text: str) -> None:
        lines.append(f"  {key:<11} {text}")

    _rl_rows(s, row)

    if "resumed_from" in s:
        r = s["resumed_from"]
        row("resumed", f"from {_short(r['checkpoint'])} (step {r['step']})")
    d = s.get("data") or {}
    if d.get("flat_tokens"):
        row("data", ("streamed; the first " if d.get("streamed") else "") + f"{d['trees']:,} trees, {d['branches']:,} branches: {d['tree_tokens']:,} tree tokens instead of "
                    f"{d['flat_tokens']:,} flat (POR {d['por']:.2f}, ideal speedup {d['ideal_speedup']:.2f}x)")
    if d.get("images"):
        row("images", f"{d['distinct_images']:,} distinct in the trees, {d['shared_images']:,} of them shared by "
                      f"several branches ({d['images']:,} shown over the branches)")
    v = s.get("verify")
    if v:
        text = (f"tree = per-branch: loss rel. diff {v.get('loss_rel_diff', float('nan')):.1e}, "
                f"gradient rel. diff {v.get('grad_rel_diff', float('nan')):.1e}")
        if "speedup" in v:
            text += f"; tree step {v['speedup']:.1f}x faster (measured on one micro-batch)"
        row("verified", text)
    if "checkpoint" in s:
        row("checkpoint", f"{_short(s['checkpoint'])}  (continue: resume_from=... trainer.max_steps=N)")
    if "export" in s:
        e = s["export"]
        kind = {"huggingface": "Hugging Face format", "lora": "LoRA adapter, PEFT's format"}.get(
            e["format"], "treelit's own format, not Hugging Face")
        row("model", f"{_short(e['path'])}  ({kind})")
        if e.get("merged"):
            row("merged", f"{_short(e['merged'])}  (the adapter merged into the base: full weights)")
    row("config", _short(s["config"]))
    m = s.get("mlflow")
    if m:
        cont = ", continued" if m.get("continued") else ""
        row("MLflow", f"run {m['run_name'] or '?'} (id {m['run_id']}{cont}), experiment '{m['experiment']}'")
        row("MLflow UI", f"{m['ui']}  then open http://127.0.0.1:5000")
    return "\n".join(lines)
