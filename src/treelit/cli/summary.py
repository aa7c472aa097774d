"""The end-of-run summary of ``treelit-train``: ``summary.json`` and a few printed lines.

What a user wants to see when a run ends: how long it took and whether the loss fell,
what the tree saved (tree vs flat tokens, POR, the speedup measured by
``verify_every`` when it ran), and where everything is - the checkpoint to resume from,
the exported model, the resolved config, the MLflow run and the command that opens the
MLflow UI on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

__all__ = ["build_summary", "format_summary"]


def _short(path: str) -> str:
    """``path`` relative to the working directory when it lies below it."""
    import os

    rel = os.path.relpath(os.path.abspath(path))
    return path if rel.startswith("..") else rel


def _duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


def build_summary(
    *,
    out: Path,
    trainer: Any,
    data_stats: Dict[str, Any],
    wall_seconds: float,
    resume: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Collect the run's results from the trainer, its callbacks and loggers (JSON-ready)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from treelit.lightning.callbacks import HFExport, StepMetrics
    from treelit.lightning.mlflow_logger import TreeMLFlowLogger
    from treelit.utils.mlflow_store import ui_command

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
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
        elif isinstance(cb, ModelCheckpoint) and cb.last_model_path:
            s["checkpoint"] = cb.last_model_path
        elif isinstance(cb, HFExport) and cb.saved is not None:
            s["export"] = {"path": str(cb.saved), "format": "treelit" if cb.native else "huggingface"}
    verify = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("verify/")}
    if verify:
        s["verify"] = verify
    if resume:
        s["resumed_from"] = {"checkpoint": resume["path"], "step": resume.get("global_step")}
    for lg in trainer.loggers:
        if isinstance(lg, TreeMLFlowLogger) and lg.run_id:
            s["mlflow"] = {
                "run_id": lg.run_id,
                "run_name": lg.experiment.get_run(lg.run_id).info.run_name,
                "experiment": lg._experiment_name,
                "tracking_uri": lg.tracking_uri,
                "continued": lg.reopened,
                "ui": ui_command(lg.tracking_uri),
            }
    return s


def format_summary(s: Dict[str, Any]) -> str:
    """A few aligned lines for the console."""
    head = f"done: {s['global_step']} steps in {_duration(s['wall_seconds'])}"
    if "loss" in s:
        (a, la), (b, lb) = s["loss"]["first"], s["loss"]["last"]
        head += f"; loss {la:.3f} (step {a}) -> {lb:.3f} (step {b})"
    lines: List[str] = [head]

    def row(key: str, text: str) -> None:
        lines.append(f"  {key:<11} {text}")

    if "resumed_from" in s:
        r = s["resumed_from"]
        row("resumed", f"from {_short(r['checkpoint'])} (step {r['step']})")
    d = s.get("data") or {}
    if d.get("flat_tokens"):
        row("data", f"{d['trees']:,} trees, {d['branches']:,} branches: {d['tree_tokens']:,} tree tokens instead of "
                    f"{d['flat_tokens']:,} flat (POR {d['por']:.2f}, ideal speedup {d['ideal_speedup']:.2f}x)")
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
        kind = "Hugging Face format" if e["format"] == "huggingface" else "treelit's own format, not Hugging Face"
        row("model", f"{_short(e['path'])}  ({kind})")
    row("config", _short(s["config"]))
    m = s.get("mlflow")
    if m:
        cont = ", continued" if m.get("continued") else ""
        row("MLflow", f"run {m['run_name']} (id {m['run_id']}{cont}), experiment '{m['experiment']}'")
        row("MLflow UI", f"{m['ui']}  then open http://127.0.0.1:5000")
    return "\n".join(lines)
