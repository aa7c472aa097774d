"""Config-time helpers: resolvers, validation of option combinations, composition for tests."""

from __future__ import annotations

import json
import os
import re
import secrets
from importlib import resources
from pathlib import Path
from datetime import datetime
from typing import List, Optional

from omegaconf import DictConfig, OmegaConf

from treelit.cli.errors import ConfigError  # (re-exported: callers import it from here)

CONF_DIR = str(resources.files("treelit") / "conf")


def bundled_path(name: str) -> str:
    """Path of a data file shipped inside the package (``treelit/data/bundled``)."""
    path = resources.files("treelit") / "data" / "bundled" / name
    if not path.is_file():
        raise ConfigError(f"no bundled data file {name!r}")
    return str(path)


def _bundled_names() -> List[str]:
    """The bundled data files, as names ``data.train_path`` and ``treelit stats`` take."""
    root = resources.files("treelit") / "data" / "bundled"
    names = []
    for entry in root.iterdir():
        if entry.is_file() and entry.name.endswith((".jsonl", ".json", ".gz", ".parquet")):
            names.append(entry.name)
        elif entry.is_dir():
            names += [f"{entry.name}/{e.name}" for e in entry.iterdir() if e.is_file() and e.name.endswith(".gz")]
    return sorted(names)


def _qwen_tokenizer() -> str:
    from treelit.data.tokenizers import qwen_tokenizer_dir

    return qwen_tokenizer_dir()


def fresh_run_name() -> str:
    """A run name unique among concurrent runs: the start time to the second, then six
    random hex digits (``2025-01-31_12-00-00-3fa2c1``)."""
    return f"{datetime.now():%Y-%m-%d_%H-%M-%S}-{secrets.token_hex(3)}"


LAST_RUN_NAME: List[str] = []  # the name this process composed last (exported to the processes Lightning starts)


def new_run_name() -> str:
    """This run's name: a fresh one (:func:`fresh_run_name`), or in a run of several processes
    the one they all agree on (:mod:`treelit.utils.launchers`: ``TREELIT_RUN_NAME``, global
    rank 0's through torchrun's store, the SLURM job's)."""
    from treelit.utils.launchers import launcher_run_name

    try:
        name = launcher_run_name(fresh_run_name)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    LAST_RUN_NAME[:] = [name]
    return name


def _env_int(*names: str) -> Optional[int]:
    for var in names:
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return None


def _node_local() -> Optional[tuple]:
    """``(node, local rank)`` of a process of Lightning's own launcher started by hand on a
    machine other than the first (``NODE_RANK`` > 0, no global rank in the environment:
    Lightning computes it later from ``trainer.devices``); ``None`` otherwise."""
    if _env_int("RANK", "SLURM_PROCID") is not None:
        return None
    node = _env_int("NODE_RANK", "GROUP_RANK") or 0
    return (node, _env_int("LOCAL_RANK") or 0) if node > 0 else None


def process_rank() -> int:
    """This process's rank in a multi-process run (0 when alone), from the launcher's environment.
    A process on a machine other than the first whose global rank is not known yet (Lightning's
    own launcher, ``NODE_RANK`` > 0) is never 0: it reports ``node * 1000 + local rank``,
    a stand-in that only serves to name it (see :func:`rank_label`)."""
    nl = _node_local()
    if nl is not None:
        return nl[0] * 1000 + nl[1]
    rank = _env_int("RANK", "LOCAL_RANK", "SLURM_PROCID")
    return 0 if rank is None else rank


def rank_label() -> str:
    """How this process names itself in file names and console prefixes: ``rank<R>``, or
    ``node<N>.rank<L>`` (local rank L on machine N) where the global rank is not known yet."""
    nl = _node_local()
    return f"node{nl[0]}.rank{nl[1]}" if nl is not None else f"rank{process_rank()}"


def rank_zero_only(value: Optional[str]) -> Optional[str]:
    """``value`` in global rank 0 (or a process alone), ``None`` in the other processes of a
    multi-process run: ``hydra.output_subdir`` - Hydra's ``.hydra/`` files are written once,
    by global rank 0, not by every process into the shared output folder."""
    return value if process_rank() == 0 else None


def rank_log_file(job_name: str) -> str:
    """The name of this process's full log in the output folder: ``<job>.log``
    (``train.log``) for global rank 0 (or a process alone), ``<job>.rank<R>.log`` for
    global rank R > 0 of a multi-process run (torchrun, srun, Lightning's launcher, whose
    processes are named ``<job>_ddp_process_<R>``), so that no two processes append to
    one file."""
    if process_rank() == 0:
        return f"{job_name}.log"
    return f"{re.sub(r'_ddp_process_[0-9]+$', '', job_name)}.{rank_label()}.log"


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("treelit.rank_zero_only"):
        OmegaConf.register_new_resolver("treelit.rank_zero_only", rank_zero_only)
    if not OmegaConf.has_resolver("treelit.rank_log_file"):
        OmegaConf.register_new_resolver("treelit.rank_log_file", rank_log_file)
    if not OmegaConf.has_resolver("treelit.run_name"):
        # cached per composed config: output_dir and the MLflow run name share one value
        OmegaConf.register_new_resolver("treelit.run_name", new_run_name, use_cache=True)
    if not OmegaConf.has_resolver("treelit.bundled"):
        OmegaConf.register_new_resolver("treelit.bundled", bundled_path)
    if not OmegaConf.has_resolver("treelit.qwen_tokenizer"):
        OmegaConf.register_new_resolver("treelit.qwen_tokenizer", _qwen_tokenizer)


def check_input_files(cfg: DictConfig) -> None:
    """The files the config names exist and look like what they should be, checked before any
    heavy import (a missing data file or a broken checkpoint is reported in about a second)."""
    from treelit.utils.paths import not_a_checkpoint

    def local(v) -> bool:  # a plain local path (not a glob, a URI or a missing value)
        return isinstance(v, str) and v not in ("", "???") and "://" not in v and not any(c in v for c in "*?[")

    data = cfg.get("data") or {}
    path = data.get("train_path") if hasattr(data, "get") else None
    if local(path) and not os.path.exists(path):
        from treelit.utils.paths import bundled_data

        if bundled_data(path) is None:  # (a bundled file's name is read from the package, as treelit stats does)
            raise ConfigError(f"data.train_path: data file {path!r} does not exist (nor is it a bundled data file: "
                              f"{', '.join(_bundled_names())})")
    source = data.get("source") if hasattr(data, "get") else None
    if hasattr(source, "get"):
        paths = source.get("paths")
        for p in ([paths] if isinstance(paths, str) else list(paths or [])):
            if local(p) and not os.path.exists(p):
                raise ConfigError(f"data.source.paths: {p!r} does not exist")
    ckpt = (cfg.get("model") or {}).get("hf_checkpoint")
    if ckpt:
        if not os.path.isdir(str(ckpt)):
            raise ConfigError(f"model.hf_checkpoint: directory {str(ckpt)!r} does not exist")
        conf = Path(str(ckpt)) / "config.json"
        if not conf.is_file():
            raise ConfigError(f"model.hf_checkpoint: {conf} does not exist (a Hugging Face checkpoint directory "
                              "has its config.json)")
        try:
            if not isinstance(json.loads(conf.read_text(encoding="utf-8")), dict):
                raise ConfigError(f"model.hf_checkpoint: {conf}: not a JSON object")
        except (ValueError, UnicodeDecodeError) as exc:
            raise ConfigError(f"model.hf_checkpoint: {conf}: invalid JSON ({exc})") from None
    resume = cfg.get("resume_from")
    if resume and str(resume) != "auto":  # auto: the run folder's newest checkpoint, looked for later
        if not os.path.exists(str(resume)):  # a file, or a sharded (FSDP2) checkpoint directory
            raise ConfigError(f"resume_from: checkpoint {str(resume)!r} does not exist")
        why = not_a_checkpoint(str(resume)) if os.path.isfile(str(resume)) else ""
        if why:
            raise ConfigError(f"resume_from: {resume} is not a checkpoint: {why}")


def validate_config(cfg: DictConfig) -> None:
    """Reject incompatible options before anything is built."""
    check_input_files(cfg)
    import torch  # cli: treelit-train --help pays for Hydra only

    att = cfg.get("attention") or {}
    if att.get("name") == "flex" and not torch.cuda.is_available():
        raise ConfigError(
            "attention=flex needs a CUDA device (FlexAttention has no backward on CPU); "
            "use attention=auto, attention=segment or attention=sdpa_dense"
        )
    if (cfg.get("ssm") or {}).get("name") == "fla" and not torch.cuda.is_available():
        raise ConfigError("ssm=fla needs a CUDA device (fla's Triton kernels); use ssm=torch")
    chunk = (cfg.get("ssm") or {}).get("chunk_size", 64)
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ConfigError(f"ssm.chunk_size must be a positive number of tokens (1 = token by token), got {chunk!r}")
    threads = cfg.get("torch_threads", "auto")
    if threads not in (None, "auto") and not (isinstance(threads, int) and not isinstance(threads, bool) and threads > 0):
        raise ConfigError(f"torch_threads must be auto, null (torch's default) or a positive number, got {threads!r}")
    if cfg.get("mode") not in ("tree", "linear"):
        raise ConfigError(f"mode must be 'tree' or 'linear', got {cfg.get('mode')!r}")
    from treelit.tree.batch import AGGREGATIONS

    if cfg.get("aggregation") not in AGGREGATIONS:
        raise ConfigError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {cfg.get('aggregation')!r}")
    tr = cfg.get("trainer") or {}
    if not tr.get("max_steps") or int(tr.get("max_steps")) <= 0:
        raise ConfigError(f"trainer.max_steps must be a positive number of optimizer steps, got {tr.get('max_steps')!r}: "
                          "training runs by steps, serving the data epoch after epoch until max_steps is reached")
    accel = tr.get("accelerator")
    if accel in ("gpu", "cuda") and not torch.cuda.is_available():
        from treelit.cli.option_checks import strategy_kind

        cpu = {"fsdp2": "trainer=fsdp2_cpu trainer.devices=2 (FSDP2 over CPU processes)",
               "ddp": "trainer=ddp_cpu trainer.devices=2 (CPU processes)"}.get(strategy_kind(cfg), "trainer=cpu")
        raise ConfigError(f"trainer.accelerator=gpu but no CUDA device is available; use {cpu}")
    planner = (cfg.get("callbacks") or {}).get("memory_planner")
    on_cpu = accel == "cpu" or (accel in (None, "auto") and not torch.cuda.is_available())
    if planner and on_cpu and planner.get("memory_limit_bytes") is None:  # (on CUDA: the free device memory)
        raise ConfigError("callbacks.memory_planner.memory_limit_bytes is needed on CPU: the memory a step may use, "
                          "in bytes (one number, or a list with one per rank)")
    strategy = (tr.get("strategy") or {})
    target = strategy.get("_target_", "") if hasattr(strategy, "get") else str(strategy)
    fsdp = "ModelParallelStrategy" in target or target.endswith("strategies.FSDP2")
    if fsdp and (cfg.get("mode") != "tree" or cfg.get("verify_every")):
        raise ConfigError("mode=linear and verify_every run per-branch passes whose number differs between ranks, "
                          "which FSDP2 (every pass gathers and reduces) cannot align; use trainer=ddp_cpu/ddp or trainer=cpu")
    from treelit.utils.launchers import launch_mismatch  # torchrun's / srun's processes vs trainer.devices x num_nodes

    mismatch = launch_mismatch(tr.get("devices"), tr.get("num_nodes", 1))
    if mismatch:
        raise ConfigError(mismatch)
    correction = (cfg.get("objective") or {}).get("behavior_correction", "none")
    if correction not in (None, "none") and cfg.get("old_logprobs") != "rollout":
        raise ConfigError(f"objective.behavior_correction={correction} compares the sampler's log-probs with the "
                          "trainer's recomputed (proximal) ones: set old_logprobs=rollout")
    check_critic_config(cfg)
    from treelit.cli.option_checks import check_options

    check_options(cfg)  # devices, strategy degrees, partition, LoRA, objective, optimizer numbers


def critic_model_config(cfg: DictConfig) -> DictConfig:
    """The model config of ``critic=separate``'s own model: the policy's (``critic.model=policy``)
    or a model group's file (``critic.model=NAME``), with ``critic.hf_checkpoint`` when given and
    without LoRA (the critic trains in full)."""
    critic = cfg.critic
    name = critic.get("model")
    if name in (None, "policy"):
        node = OmegaConf.create(OmegaConf.to_container(cfg.model, resolve=True))
    else:
        folder = Path(__file__).resolve().parent.parent / "conf" / "model"
        known = sorted(p.stem for p in folder.glob("*.yaml"))
        if not isinstance(name, str) or name not in known:
            raise ConfigError(f"critic.model={name!r}: not a model config; use policy or one of {', '.join(known)}")
        node = OmegaConf.load(folder / f"{name}.yaml")
    if critic.get("hf_checkpoint"):
        node.hf_checkpoint = str(critic.hf_checkpoint)
    if "lora" in node:
        node.lora.rank = None
    return node


def check_critic_config(cfg: DictConfig) -> None:
    """The ``critic`` group against the rest of the run, one line naming the option."""
    critic = cfg.get("critic") or {}
    kind = critic.get("kind", "none")
    if kind in (None, "none"):
        return
    from treelit.models.critic import check_critic_options

    try:
        check_critic_options(kind, critic.get("vf_coef"), critic.get("value_clip"), critic.get("lr"))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    name = (cfg.get("objective") or {}).get("name")
    if name != "ppo":
        raise ConfigError(f"critic={kind} trains with objective=ppo (GAE advantages from a value function), not "
                          f"objective={name}")
    level = (cfg.get("objective") or {}).get("behavior_is_level", "token")
    if level not in (None, "token"):
        raise ConfigError(f"critic={kind} with objective.behavior_is_level={level}: a sequence-level correction weights "
                          "whole branches, and the critic's advantages are per token; use objective.behavior_is_level=token")
    adv = (cfg.get("tree_builder") or {}).get("advantage")
    if adv not in (None, "none"):
        raise ConfigError(f"critic={kind} with tree_builder.advantage={adv}: the critic computes the advantages (GAE "
                          "from the rewards and its values); set tree_builder.advantage=null")
    if kind == "separate" and not critic.get("hf_checkpoint") and not critic.get("model"):
        raise ConfigError("critic=separate needs its own model: critic.hf_checkpoint=DIR (a checkpoint folder) or "
                          "critic.model=policy|NAME (the policy's model config, or a model group name such as tiny)")
    if kind == "separate":
        critic_model_config(cfg)  # an unknown model name is named here


def compose(overrides: Optional[List[str]] = None, config_name: str = "train") -> DictConfig:
    """Compose the real treelit config (as ``treelit-train`` would) - for tests and notebooks."""
    from hydra import compose as hydra_compose  # cli: commands that compose no config pay no Hydra
    from hydra import initialize_config_dir  # as above

    register_resolvers()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []), return_hydra_config=False)
