"""One run name for every process of a run, whoever launched the processes.

``treelit-train`` names a run when Hydra composes its config (``output_dir:
outputs/${treelit.run_name:}``, the MLflow run name), and Hydra composes the config in
every process, before ``torch.distributed`` is initialised. The processes of one run must
nevertheless agree on the name (one output folder, one sharded checkpoint, one MLflow run):

* **Lightning's own launcher** (``trainer=ddp_cpu``, ``fsdp2_cpu`` on one machine) starts
  the other processes from the first one during ``fit``; the first exports its name in
  ``TREELIT_RUN_NAME`` (:func:`shared_run_name`) and they read it.
* **torchrun** (``--nnodes N --nproc-per-node M``): global rank 0 makes up the name and
  publishes it in the rendezvous store that torchrun's agent on the first node keeps at
  ``MASTER_ADDR:MASTER_PORT`` for the job (a fresh store per attempt); the other ranks read
  it from there (waiting at most :data:`STORE_TIMEOUT_S`).
* **SLURM** (``srun treelit-train`` with several tasks): the name is the job's,
  ``slurm-<SLURM_JOB_ID>`` (``-r<n>`` after the n-th requeue).
* ``TREELIT_RUN_NAME`` set by the user names the run in every process.

Processes started otherwise (``RANK``/``WORLD_SIZE`` set by hand, another launcher) cannot
agree on a name: each makes up its own, with a warning; give them all the same ``output_dir``.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, Optional

import torch.distributed as dist

__all__ = ["RUN_NAME_ENV", "STORE_TIMEOUT_S", "launch_mismatch", "launcher", "launcher_run_name", "shared_run_name"]

RUN_NAME_ENV = "TREELIT_RUN_NAME"
STORE_TIMEOUT_S = 600.0
_STORE_KEY = "treelit/run_name"


def _int(value: Optional[str], default: int = 0) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return default


def launcher(env: Optional[Dict[str, str]] = None) -> Optional[str]:
    """``torchrun``, ``slurm``, ``other`` (a multi-process world set up by hand) or ``None``
    (one process, or a process Lightning's own launcher started) from the environment."""
    env = os.environ if env is None else env
    if env.get(RUN_NAME_ENV):
        return None
    if env.get("TORCHELASTIC_RUN_ID") is not None and _int(env.get("WORLD_SIZE"), 1) > 1:
        return "torchrun"
    if env.get("SLURM_JOB_ID") and env.get("SLURM_PROCID") is not None and _int(env.get("SLURM_NTASKS"), 1) > 1:
        return "slurm"
    if _int(env.get("WORLD_SIZE"), 1) > 1:
        return "other"
    return None


def launcher_run_name(fresh: Callable[[], str], env: Optional[Dict[str, str]] = None) -> str:
    """The run name of this process: ``TREELIT_RUN_NAME`` when set, else the one the
    launcher's processes agree on (see the module's text), else ``fresh()`` (with a warning
    when the processes of a multi-process world cannot agree). Raises ``ValueError`` (one
    line) when torchrun's store does not answer."""
    env = os.environ if env is None else env
    if env.get(RUN_NAME_ENV):
        return str(env[RUN_NAME_ENV])
    kind = launcher(env)
    if kind is None:
        return fresh()
    if kind == "slurm":
        restarts = _int(env.get("SLURM_RESTART_COUNT"))
        return f"slurm-{env['SLURM_JOB_ID']}" + (f"-r{restarts}" if restarts else "")
    if kind == "torchrun" and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return _from_store(fresh, env)
    if kind == "torchrun" and env.get("TORCHELASTIC_RUN_ID") not in (None, "", "none"):  # --rdzv-id
        restarts = _int(env.get("TORCHELASTIC_RESTART_COUNT"))
        return f"torchrun-{env['TORCHELASTIC_RUN_ID']}" + (f"-r{restarts}" if restarts else "")
    print(f"warning: {_int(env.get('WORLD_SIZE'), 1)} processes (no torchrun store, no SLURM job) cannot agree on "
          f"a run name, each makes up its own: give them all the same output_dir=DIR (or {RUN_NAME_ENV}=NAME)", file=sys.stderr)
    return fresh()


def launch_mismatch(devices: object, num_nodes: object, env: Optional[Dict[str, str]] = None) -> Optional[str]:
    """One line saying how ``trainer.devices`` / ``trainer.num_nodes`` disagree with the processes
    an external launcher started, else ``None``. Lightning picks the launcher's environment as it
    does (torchrun: ``TORCHELASTIC_RUN_ID``; else SLURM: ``SLURM_NTASKS``, unless the job is named
    ``bash`` or ``interactive``) but checks these numbers only when it starts the processes itself,
    so a mismatch would otherwise fail in the device mesh after the data is read, with a traceback."""
    env = os.environ if env is None else env
    if isinstance(devices, bool) or not isinstance(devices, int) or isinstance(num_nodes, bool) \
            or not isinstance(num_nodes, int):
        return None  # devices=auto or a list: Lightning's to resolve
    asked = f"trainer.devices={devices} x trainer.num_nodes={num_nodes} = {devices * num_nodes} processes"
    if env.get("TORCHELASTIC_RUN_ID") is not None:
        world = _int(env.get("WORLD_SIZE"), 0)
        if world and world != devices * num_nodes:
            return (f"{asked}, but torchrun started {world} (WORLD_SIZE): set trainer.devices to --nproc-per-node "
                    "and trainer.num_nodes to --nnodes")
        return None
    if env.get("SLURM_NTASKS") is None or env.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return None
    tasks, per_node = _int(env.get("SLURM_NTASKS"), 0), env.get("SLURM_NTASKS_PER_NODE")
    hint = "set trainer.devices to --ntasks-per-node and trainer.num_nodes to --nodes, and start the tasks with srun"
    if tasks > 1 and per_node is None:
        return (f"SLURM started {tasks} tasks (SLURM_NTASKS) without --ntasks-per-node, which Lightning needs to "
                f"place them: use --nodes and --ntasks-per-node ({asked})")
    if tasks != devices * num_nodes:
        return f"{asked}, but SLURM started {tasks} task{'s' * (tasks != 1)} (SLURM_NTASKS): {hint}"
    if per_node is not None and _int(per_node, devices) != devices:
        return f"trainer.devices={devices}, but SLURM starts {per_node} tasks per node (--ntasks-per-node): {hint}"
    nodes = env.get("SLURM_NNODES")
    if nodes is not None and _int(nodes, num_nodes) != num_nodes:
        return f"trainer.num_nodes={num_nodes}, but the SLURM job has {nodes} nodes (--nodes): {hint}"
    return None


def _from_store(fresh: Callable[[], str], env: Dict[str, str]) -> str:
    host, port = env.get("MASTER_ADDR", "127.0.0.1"), _int(env.get("MASTER_PORT"))
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S))
        if _int(env.get("RANK")) == 0:
            store.set(_STORE_KEY, fresh())
        return store.get(_STORE_KEY).decode()
    except (RuntimeError, OSError) as exc:  # DistStoreError (a RuntimeError) when it times out
        raise ValueError(f"the run name of global rank 0 did not arrive from torchrun's store at {host}:{port} "
                         f"within {STORE_TIMEOUT_S:g}s ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                         "give every process the same output_dir=DIR") from None


@contextmanager
def shared_run_name(name: Optional[str]) -> Iterator[None]:
    """Export ``name`` in ``TREELIT_RUN_NAME`` for the ``with`` block (restored afterwards),
    so that the processes Lightning's launcher starts meanwhile compose the same name."""
    previous = os.environ.get(RUN_NAME_ENV)
    if name and not previous:
        os.environ[RUN_NAME_ENV] = name
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(RUN_NAME_ENV, None)
