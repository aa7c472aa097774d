"""Running ``treelit-train`` as a user would: a subprocess with tiny overrides."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Dict, List, Optional

# a one-layer model on 8 trees, no progress bar, one OpenMP thread (runs share 2 cores)
TINY = [
    "model.config.num_layers=1",
    "model.config.embed_dim=32",
    "model.config.intermediate_dim=64",
    "data.max_trees=8",
    "callbacks.progress=null",
    "trainer.enable_progress_bar=false",
]


def cli_env(**extra: str) -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HYDRA_FULL_ERROR="0")
    env.pop("MLFLOW_TRACKING_URI", None)
    env.update(extra)
    return env


def cli_cmd(*args: str) -> List[str]:
    return [sys.executable, "-m", "treelit.cli.train", *args]


def start(*args: str, cwd, env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
    return subprocess.Popen(cli_cmd(*args), cwd=str(cwd), env=env or cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def runs(uri: str, experiment: str = "treelit"):
    """The MLflow runs of ``experiment`` in the store ``uri`` (oldest first)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return client, []
    return client, sorted(client.search_runs([exp.experiment_id]), key=lambda r: r.info.start_time)


def quotes_balance(msg: str) -> bool:
    """Every quotation mark of ``msg`` has its partner (an apostrophe inside a word is none)."""
    bare = re.sub(r"(?<=\w)'(?=\w)", "", msg)  # run's, don't
    bare = re.sub(r"(?<=s)'(?=[\s,;:)])", "", bare)  # the processes' (a plural's apostrophe)
    return all(bare.count(q) % 2 == 0 for q in ("'", '"', "`"))
