"""Shared pieces of the fault tests: a small token-tree file, the overrides of a tiny run, a
training subprocess with a deadline (every process it starts is killed when it passes, so a hang
fails instead of blocking), and the exported weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import treelit
from treelit.cli.config import compose
from treelit.cli.train import run

HERE = Path(__file__).resolve().parent
EXE = str(Path(sys.executable).with_name("treelit-train"))

# a one-layer model; 8 trees packed two per micro-batch, two micro-batches per step: a data
# epoch is 2 steps; no progress bar, no MLflow
TINY = [
    "logger=none", "callbacks.progress=null", "trainer.enable_progress_bar=false",
    "model.config.num_layers=1", "model.config.embed_dim=32", "model.config.intermediate_dim=64",
    "data=jsonl", "data.shuffle=false", "data.micro_batch_tokens=40", "data.micro_batches_per_step=2",
]
TOKEN = 300  # a token only tree t5 holds


def write_trees(path: Path, n: int = 8, huge_weight: Optional[int] = None, token_in: Optional[int] = None) -> Path:
    """``n`` trees ``t0`` .. (three branches each, one record per line); tree ``huge_weight`` has a
    branch weighing 1e308 (its loss overflows to inf); tree ``token_in`` holds :data:`TOKEN`."""
    with path.open("w") as f:
        for t in range(n):
            branches = [{"input_ids": [1, 2, 3, 4 + t] + [10 + b + t] * 5} for b in range(3)]
            if t == huge_weight:
                branches[0]["weight"] = 1e308
            if t == token_in:
                branches[1]["input_ids"][-1] = TOKEN
            f.write(json.dumps({"id": f"t{t}", "branches": branches}) + "\n")
    return path


def checkpointed_run(out: Path, data: Path, steps: int = 4) -> Path:
    """A run of ``steps`` steps in-process, never interrupted, a checkpoint after every step."""
    run(compose([*TINY, f"data.train_path={data}", f"output_dir={out}", f"trainer.max_steps={steps}",
                 "callbacks.checkpoint.every_n_train_steps=1"]))
    return out


def inject(name: str, target: str, **options) -> List[str]:
    """The overrides that add the test callback ``injectors.<target>`` as ``callbacks.<name>``."""
    out = [f"+callbacks.{name}._target_=injectors.{target}"]
    for k, v in options.items():
        out.append(f"+callbacks.{name}.{k}={'null' if v is None else v}")
    return out


def env(**extra: str) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))
         and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TREELIT_RUN_NAME",
                       "MLFLOW_TRACKING_URI")}
    e.update(OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="0",
             PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    e.update(extra)
    return e


def train(args: Sequence[str], cwd: Path, timeout: float = 400, until: Optional[Callable[[], bool]] = None,
          then: int = signal.SIGTERM, extra_env: Optional[dict] = None) -> Tuple[int, str, str]:
    """``treelit-train ARGS`` in a subprocess (its own session): (exit code, stdout, stderr). With
    ``until``: once ``until()`` is true, signal ``then`` goes to every process of the run."""
    out, err = cwd / f"run{time.monotonic_ns()}.out", cwd / f"run{time.monotonic_ns()}.err"
    with out.open("w") as fo, err.open("w") as fe:
        proc = subprocess.Popen([EXE, *args], cwd=cwd, stdout=fo, stderr=fe, env=env(**(extra_env or {})),
                                start_new_session=True)
        end, sent = time.monotonic() + timeout, False
        while proc.poll() is None:
            if until is not None and not sent and until():
                os.killpg(proc.pid, then)
                sent = True
            if time.monotonic() > end:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise AssertionError(f"treelit-train still running after {timeout}s (killed): "
                                     f"{err.read_text()[-3000:]}")
            time.sleep(0.05)
    time.sleep(0.2)  # processes Lightning's launcher started end with their parent
    return proc.returncode, out.read_text(errors="replace"), err.read_text(errors="replace")


def one_error_line(err: str) -> str:
    """The whole of stderr is exactly one ``error: ...`` line: that line."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-4000:]
    assert "Traceback" not in err
    return lines[0]


def weights(out: Path) -> dict:
    return treelit.load_hf_checkpoint(out / "hf_checkpoint").state_dict()


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and bool((a[k] == b[k]).all()), k


def load_sharded(directory: Path) -> dict:
    """Every tensor of a sharded (FSDP2) checkpoint directory, gathered, by dotted path."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(directory), f"{tmp}/all.pt")
        state = torch.load(f"{tmp}/all.pt", weights_only=False)
    out: dict = {}

    def walk(prefix: str, node) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(f"{prefix}.{i}", v)
        elif isinstance(node, torch.Tensor):
            out[prefix] = node

    walk("", state.get("state_dict", state))
    return out
