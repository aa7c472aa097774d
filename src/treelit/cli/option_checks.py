"""Options judged before launch: every setting the composed config alone decides.

A multi-process run starts its processes in ``trainer.fit``; a setting that is only judged
there (the strategy's ``setup_environment``, the optimizer's first step, the module's
constructor) fails once per process, after the MLflow run was opened, with a traceback each.
Everything here reads the config only - no model, no data, no process group - so a bad value
is one ``error:`` line naming the option and the fix within seconds, before any process is
started or any run is tracked (the ``model`` group's routing and vision options:
:mod:`treelit.cli.model_option_checks`). The objects cheap to build (the objective, the optimizer
on a two-element parameter, the learning-rate schedule) are built here and thrown away, so
their own checks run too; what needs the model (LoRA targets, the layer kinds context
parallelism covers) is judged when the model is built, still before launch.

``tests/cli/test_option_space.py`` walks combinations of these options: each one either
passes or is refused in one line, and a sample of the passing ones trains a step.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from omegaconf import DictConfig

from treelit.cli.errors import ConfigError

__all__ = ["check_options", "strategy_kind", "world_size"]


def _error(msg: str) -> Exception:
    return ConfigError(msg)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _first_line(exc: BaseException) -> str:
    text = str(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def check_options(cfg: DictConfig) -> None:
    """Raise :class:`~treelit.cli.config.ConfigError` (one line) for the first bad setting."""
    _check_run_numbers(cfg)
    _check_processes(cfg)
    _check_partition(cfg)
    _check_lora(cfg)
    from treelit.cli.model_option_checks import check_model_options

    check_model_options(cfg)  # model.moe.routing, model.vision and what it runs with
    _check_compile(cfg)
    objective = _check_objective(cfg)
    _check_optimizer(cfg)
    if (cfg.get("partition") or {}).get("name", "none") != "none" and objective is not None:
        from treelit.objectives.folding import fold_spec

        try:
            fold_spec(objective)
        except NotImplementedError as exc:
            raise _error(f"partition={cfg.partition.name}: {_first_line(exc)}") from None


# run-level numbers ------------------------------------------------------------------------------

def _check_run_numbers(cfg: DictConfig) -> None:
    clip = cfg.get("grad_clip", 1.0)
    if clip is not None and not (_is_number(clip) and math.isfinite(clip) and clip >= 0):
        raise _error(f"grad_clip must be a number >= 0 (the largest global gradient norm; null or 0: no clipping), "
                     f"got {clip!r}")
    verify = cfg.get("verify_every", 0)
    if not (_is_int(verify) and verify >= 0):
        raise _error(f"verify_every must be a number of steps >= 0 (0: never), got {verify!r}")
    rows = cfg.get("chunk_rows")
    if rows is not None and not (_is_int(rows) and rows > 0):
        raise _error(f"chunk_rows must be a positive number of rows (null: 1/32 of a GPU's memory of logits, ~32 MiB on CPU), got {rows!r}")
    for key in ("ppo_epochs", "ppo_minibatches"):
        v = cfg.get(key, 1)
        if not (_is_int(v) and v >= 1):
            raise _error(f"{key} must be a positive integer, got {v!r}")
    if cfg.get("old_logprobs", "data") not in ("data", "rollout"):
        raise _error(f"old_logprobs must be data or rollout, got {cfg.get('old_logprobs')!r}")
    nonfinite = cfg.get("on_nonfinite", "stop")
    if nonfinite not in ("stop", "skip_step"):
        raise _error(f"on_nonfinite={nonfinite} is not a choice: use stop or skip_step")
    skips = cfg.get("max_skipped_steps", 10)
    if not (_is_int(skips) and skips >= 1):
        raise _error(f"max_skipped_steps={skips} must be at least 1 (a number of consecutive dropped updates)")
    if not _is_int(cfg.get("seed", 0)):
        raise _error(f"seed must be an integer, got {cfg.get('seed')!r}")


# processes: devices, nodes, the strategy and its degrees ----------------------------------------

def strategy_kind(cfg: DictConfig) -> Optional[str]:
    """``fsdp2``, ``ddp``, ``None`` (no strategy: Lightning's default) or ``other`` (a user's own)."""
    strategy = (cfg.get("trainer") or {}).get("strategy")
    if strategy is None:
        return None
    target = str(strategy.get("_target_", "")) if hasattr(strategy, "get") else str(strategy)
    if "ModelParallelStrategy" in target or target.endswith("strategies.FSDP2"):
        return "fsdp2"
    if target.endswith("strategies.DDP"):
        return "ddp"
    return "other"


def _on_gpu(tr: Any) -> bool:
    return tr.get("accelerator") in ("gpu", "cuda", "auto", None)


def world_size(cfg: DictConfig) -> Optional[int]:
    """The run's processes (``trainer.devices x trainer.num_nodes``), None where the devices are
    counted at launch (``auto``, ``-1`` on GPU)."""
    tr = cfg.get("trainer") or {}
    devices, nodes = tr.get("devices", 1), tr.get("num_nodes", 1) or 1
    if _is_int(devices) and devices > 0:
        return devices * nodes
    if isinstance(devices, (list, tuple)) or hasattr(devices, "__len__") and not isinstance(devices, str):
        return len(devices) * nodes
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()]) * nodes
    return None


def _check_processes(cfg: DictConfig) -> None:
    tr = cfg.get("trainer") or {}
    nodes = tr.get("num_nodes", 1)
    if not (_is_int(nodes) and nodes >= 1):
        raise _error(f"trainer.num_nodes must be a positive number of machines, got {nodes!r}")
    devices = tr.get("devices", 1)
    gpu = _on_gpu(tr)
    if _is_int(devices):
        if devices < 1 and not (devices == -1 and gpu):
            every = " (-1 on GPU: every visible device)" if gpu else ""
            raise _error(f"trainer.devices must be a positive number of processes per machine{every}, got {devices!r}")
    elif isinstance(devices, str) and devices != "auto" and not all(d.strip().isdigit() for d in devices.split(",")):
        raise _error(f"trainer.devices must be a positive number of processes per machine (or auto), got {devices!r}")
    elif isinstance(devices, bool) or devices is None:
        raise _error(f"trainer.devices must be a positive number of processes per machine, got {devices!r}")
    if _is_int(devices) and devices > 1 and tr.get("accelerator") in ("gpu", "cuda"):
        import torch  # cli: treelit-train --help pays for Hydra only

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if 0 < have < devices:  # (no CUDA device at all: refused with its own line)
            raise _error(f"trainer.devices={devices} processes on this machine, which has {have} CUDA device"
                         f"{'s' if have != 1 else ''}: use trainer.devices={have} (or -1: every visible device)")
    kind = strategy_kind(cfg)
    if kind not in ("ddp", "fsdp2"):
        return
    strategy = tr.strategy
    timeout = strategy.get("timeout_s", 1800)
    if not (_is_number(timeout) and math.isfinite(timeout) and timeout > 0):
        raise _error(f"trainer.strategy.timeout_s must be a positive number of seconds, got {timeout!r}")
    cp = strategy.get("context_parallel_degree", 1)
    if not (_is_int(cp) and cp >= 1):
        raise _error(f"trainer.strategy.context_parallel_degree must be a positive integer (1: off), got {cp!r}")
    fsdp_trainer = "trainer=fsdp2" if gpu and tr.get("accelerator") != "cpu" else "trainer=fsdp2_cpu"
    if kind == "ddp":
        if cp != 1:
            raise _error(f"trainer.strategy.context_parallel_degree={cp} under DDP: context parallelism runs on the "
                         f"FSDP2 strategies; use {fsdp_trainer} trainer.devices={max(cp, 2)} "
                         f"trainer.strategy.context_parallel_degree={cp} (or context_parallel_degree=1)")
        return
    _check_fsdp2(cfg, strategy, cp)


def _check_fsdp2(cfg: DictConfig, strategy: Any, cp: int) -> None:
    replicas = strategy.get("replicate_degree", 1)
    if not (_is_int(replicas) and replicas >= 1):
        raise _error(f"trainer.strategy.replicate_degree must be a positive number of replicas (1: FSDP2 over every "
                     f"process), got {replicas!r}")
    tp = strategy.get("tensor_parallel_size", 1)
    if replicas > 1 and tp != 1:
        raise _error(f"trainer.strategy.replicate_degree={replicas} (HSDP) needs trainer.strategy.tensor_parallel_size=1, "
                     f"got {tp!r}")
    from treelit.utils.distributed import mixed_precision_policy

    try:
        mixed_precision_policy(strategy.get("param_dtype"), strategy.get("reduce_dtype"))
    except ValueError as exc:
        raise _error(f"trainer.strategy.param_dtype/reduce_dtype: {_first_line(exc)} (null: the model's own)") from None
    tr = cfg.trainer
    world = world_size(cfg)
    if world is not None:
        shape = f"trainer.devices={tr.get('devices')} x trainer.num_nodes={tr.get('num_nodes', 1)}"
        if world % replicas:
            raise _error(f"trainer.strategy.replicate_degree={replicas} (HSDP replicas) must divide the {world} "
                         f"processes ({shape}); use a divisor of {world}")
        per_replica = world // replicas
        if cp > 1 and per_replica % cp:
            fits = [c for c in range(2, per_replica + 1) if per_replica % c == 0]
            hint = (f"context_parallel_degree={' or '.join(map(str, fits))}" if fits else
                    "context_parallel_degree=1")
            raise _error(f"trainer.strategy.context_parallel_degree={cp} does not divide the {per_replica} processes "
                         f"of a replica ({shape}"
                         + (f" / replicate_degree={replicas}" if replicas > 1 else "")
                         + f"): use {hint}, or trainer.devices={cp * replicas} for {cp} ranks per tree row")
    if cp > 1:
        att = (cfg.get("attention") or {}).get("name", "auto")
        from treelit.partition.context_parallel import check_cp_backend

        try:
            check_cp_backend(att)
        except (ValueError, KeyError) as exc:
            raise _error(_first_line(exc)) from None


# partitioning, LoRA, the objective ---------------------------------------------------------------

def _check_partition(cfg: DictConfig) -> None:
    part = cfg.get("partition") or {}
    name = part.get("name", "none")
    if name != "none":
        from treelit.partition import PARTITIONS

        try:
            PARTITIONS.get(name)  # unknown names list the known ones
        except KeyError as exc:
            raise _error(_first_line(exc)) from None
    budget = part.get("budget_tokens")
    if budget is not None and not (_is_int(budget) and budget > 0):
        raise _error(f"partition.budget_tokens must be a positive number of tokens (null: set by the memory planner), "
                     f"got {budget!r}")
    if name != "none":
        from treelit.partition.context_parallel import check_cp_backend

        try:
            check_cp_backend((cfg.get("attention") or {}).get("name", "auto"), f"partition={name}",
                             "a partition's ancestors in earlier passes")
        except (ValueError, KeyError) as exc:
            raise _error(_first_line(exc)) from None


def _check_lora(cfg: DictConfig) -> None:
    from treelit.models.lora import lora_options

    lora = (cfg.get("model") or {}).get("lora")
    try:
        opts = lora_options(lora)
    except ValueError as exc:
        raise _error(_first_line(exc)) from None
    if opts is not None and opts["dropout"] > 0 and cfg.get("mode", "tree") == "tree":
        raise _error(f"model.lora.dropout={opts['dropout']}: in tree mode a shared token would get one dropout mask "
                     "for every branch through it, which per-branch training does not; set model.lora.dropout=0 "
                     "(or mode=linear)")
    if (cfg.get("objective") or {}).get("reference") == "base" and opts is None:
        raise _error("objective.reference=base is the model with its LoRA adapters off, and this model has none: set "
                     "model.lora.rank (or objective.reference=initial for a frozen copy)")


def _check_compile(cfg: DictConfig) -> None:
    """``compile``: a backend name or a boolean, on a model and strategy whose layers treelit runs."""
    setting = cfg.get("compile", False)
    if setting in (False, None):
        return
    from treelit.models.compiled import compile_backend

    try:
        compile_backend(setting)
    except ValueError as exc:
        raise _error(_first_line(exc)) from None
    setting = str(setting).lower() if isinstance(setting, bool) else setting  # as written: compile=true
    target = str((cfg.get("model") or {}).get("_target_", ""))
    if target.startswith("treelit.models.hf_adapter"):
        raise _error(f"compile={setting}: the transformers adapter (model=hf_auto) runs eager; use model=hf (treelit's "
                     "own decoder for Llama, Qwen2/2.5/3, Mistral checkpoints) or compile=false")
    if strategy_kind(cfg) == "fsdp2":
        raise _error(f"compile={setting} is not supported with FSDP2 (trainer=fsdp2, fsdp2_cpu): use trainer=ddp, "
                     "ddp_cpu, cpu or gpu, or compile=false")


def _build(node: Any, what: str) -> Any:
    import hydra  # cli: treelit-train --help pays for Hydra only
    from hydra.errors import InstantiationException  # as above

    try:
        return hydra.utils.instantiate(node)
    except InstantiationException as exc:
        cause = exc
        while isinstance(cause, InstantiationException) and cause.__cause__ is not None:
            cause = cause.__cause__
        if isinstance(cause, KeyError):  # a registry's unknown name: its line lists the known ones
            raise cause from None
        raise _error(f"{what}: {_first_line(cause)}") from None
    except (ValueError, TypeError) as exc:
        raise _error(f"{what}: {_first_line(exc)}") from None


def _check_objective(cfg: DictConfig) -> Any:
    node = cfg.get("objective")
    if not node or "_target_" not in node:
        return None
    return _build(node, f"objective={node.get('name')}")


# the optimizer's numbers ------------------------------------------------------------------------

def _check_optimizer(cfg: DictConfig) -> None:
    import torch  # cli: treelit-train --help pays for Hydra only

    node = cfg.get("optimizer")
    if not node or "_target_" not in node:
        return
    name = str((cfg.get("model") or {}).get("dtype") or "float32")
    dtype = getattr(torch, name, None)
    dtype = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32
    lr = node.get("lr")
    if lr is not None:
        if not (_is_number(lr) and math.isfinite(lr) and lr >= 0):
            raise _error(f"optimizer.lr must be a finite number >= 0, got {lr!r}")
        big = torch.finfo(dtype).max
        if lr > big:
            raise _error(f"optimizer.lr={lr:g} is larger than the largest {dtype} number ({big:.3g}): the optimizer "
                         f"cannot apply it to model.dtype={name} parameters; use a learning rate such as 3e-4")
    factory = _build(node, "optimizer")
    param = torch.nn.Parameter(torch.zeros(2, dtype=dtype))
    try:
        optimizer = factory([param])
        param.grad = torch.ones_like(param)
        optimizer.step()  # its own checks of its numbers, and any overflow of them in this dtype
    except (ValueError, TypeError, RuntimeError, OverflowError) as exc:
        raise _error(f"optimizer ({node.get('_target_')}): {_first_line(exc)}") from None
    sched = cfg.get("scheduler")
    if sched and "_target_" in sched:
        make = _build(sched, "scheduler")
        try:
            make(optimizer)
        except (ValueError, TypeError, ZeroDivisionError) as exc:
            raise _error(f"scheduler: {_first_line(exc)}") from None
