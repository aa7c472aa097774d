"""``treelit-train``: compose an experiment from config groups, train with Lightning, track in MLflow.

    treelit-train                                   # tiny model, bundled synthetic agent data, CPU
    treelit-train model.hf_checkpoint=DIR data=jsonl data.train_path=trees.jsonl optimizer=sgd
    treelit-train experiment=tau_bench_sft          # real tau-bench trajectories, chat builder
    treelit-train --help                            # all groups and options

Reads top to bottom: validate options, check the output directory, read the checkpoint
to resume from, build model, data (trees checked against the model), objective,
module, callbacks, loggers, trainer; fit; export; summary. Errors in the user's
input (data, config, checkpoints, output directory) print one line, no traceback
(``HYDRA_FULL_ERROR=1`` shows it).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from treelit.cli import startup_signals  # before anything heavy: see below

if os.path.basename(sys.argv[0] if sys.argv else "") == "treelit-train":
    startup_signals.install()  # the console script: a preemption signal from here on ends with code 75

import hydra  # noqa: E402
from hydra.errors import InstantiationException  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from treelit.cli.config import CONF_DIR, LAST_RUN_NAME, ConfigError, register_resolvers, validate_config
from treelit.cli.console import (SetupError, full_error_requested, hydra_error_message, process_rank,
                                 quiet_transformers_bars, tidy_library_logging, user_error_message)
from treelit.cli.option_checks import world_size
from treelit.cli.preflight import check_space, check_writable, lock_output_dir
from treelit.cli.resume import find_resume_checkpoint, read_resume_checkpoint  # noqa: F401  (tests, tools)
from treelit.cli.rerun import check_earlier_run
from treelit.cli.resume import resume as _resume
from treelit.cli.startup_lines import cp_line, images_line, routing_line
from treelit.cli.startup_signals import StartupPreempted
from treelit.cli.summary import data_line
from treelit.utils.redact import redact_config, redact_text

log = logging.getLogger("treelit.train")


def build(node: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` that surfaces treelit's own error (which names the
    option and the known choices) instead of Hydra's wrapper around it."""
    try:
        return hydra.utils.instantiate(node, **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__
        while isinstance(cause, InstantiationException) and cause.__cause__ is not None:  # nested nodes
            cause = cause.__cause__
        if isinstance(cause, (ValueError, KeyError, OSError)):
            raise cause from None
        raise


def _instantiate_all(group: Any) -> List[Any]:
    if not group:
        return []
    return [build(node) for node in group.values() if node]


def _flat_params(cfg: DictConfig) -> Dict[str, Any]:
    flat: Dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = node

    walk("", redact_config(OmegaConf.to_container(cfg, resolve=True)))
    return {k: v for k, v in flat.items() if not k.startswith("hydra")}


def _check_budget(cfg: DictConfig, data_stats: Dict[str, Any]) -> None:
    """A fixed partition budget must hold the longest branch (of the data, or of the trees a
    stream has read so far; a later streamed tree is reported when it comes)."""
    budget = (cfg.get("partition") or {}).get("budget_tokens")
    longest = data_stats.get("longest_branch") or 0
    planner = (cfg.get("callbacks") or {}).get("memory_planner")  # chooses its own budget each step
    strategy = (cfg.get("trainer") or {}).get("strategy")
    C = strategy.get("context_parallel_degree", 1) if hasattr(strategy, "get") else 1
    C = C if isinstance(C, int) and C > 1 else 1  # (a bad value is reported where the strategy is built)
    if cfg.partition.name == "redundancy_free" and budget is not None and not planner and longest > C * int(budget):
        if C > 1:
            raise ConfigError(f"partition.budget_tokens={budget} (per rank) x context_parallel_degree={C} cannot hold "
                              f"the longest branch of the data ({longest} tokens): a partition chain holds at least one "
                              f"root-to-leaf path; use at least {-(-longest // C)}")
        raise ConfigError(f"partition.budget_tokens={budget} cannot hold the longest branch of the data ({longest} "
                          f"tokens): a partition chain holds at least one root-to-leaf path; use at least {longest}")


@contextmanager
def _setup_errors() -> Iterator[None]:
    """Invalid option values found while building the run are user errors (see console.py)."""
    try:
        yield
    except (ValueError, KeyError) as exc:
        if user_error_message(exc) is not None:
            raise
        text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)  # (a KeyError's str is its repr)
        raise SetupError(text) from exc


SMALL_MODEL_PARAMS = 5_000_000


@contextmanager
def _torch_threads(setting: Any, model: Any, accelerator: str) -> Iterator[None]:
    """CPU intra-op threads for the run (restored afterwards). ``auto``: one thread for a model
    under 5M parameters on CPU - its operations are too small to gain from splitting, and
    OpenMP threads spin-wait for each other, so on cores shared with other work a two-thread
    step was measured 5x slower than a one-thread step - unless ``OMP_NUM_THREADS`` is set;
    torch's default otherwise. ``null``: torch's default; a number: that many threads."""
    import torch  # cli: treelit-train --help pays for Hydra only

    n: Optional[int] = None
    if setting not in (None, "auto"):
        n = int(setting)
    elif setting == "auto" and accelerator == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
        params = sum(p.numel() for p in model.parameters())
        if params < SMALL_MODEL_PARAMS:
            n = 1
            log.info("torch_threads=auto: 1 CPU thread for a model of %.2fM parameters (set torch_threads=N "
                     "to change)", params / 1e6)
    previous = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _build_loggers(group: Any, resume: Optional[Dict[str, Any]]) -> List[Any]:
    """The configured loggers; an MLflow logger on the store a resumed checkpoint came from
    reopens the checkpoint's run."""
    from treelit.utils.mlflow_store import DEFAULT_TRACKING_URI, resolve_tracking_uri

    loggers = []
    for node in (group or {}).values():
        if not node:
            continue
        if "MLFlow" in str(node.get("_target_", "")):
            import mlflow  # noqa: F401  (heavy, with the MLflow logger only: installs log handlers the next line removes)

            tidy_library_logging()
        kwargs: Dict[str, Any] = {}
        link = (resume or {}).get("mlflow")
        if link and str(node.get("_target_", "")).endswith("TreeMLFlowLogger"):
            uri = node.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
            # checkpoints hold the store's URI with its credentials redacted
            if redact_text(resolve_tracking_uri(str(uri))) == redact_text(str(link.get("tracking_uri"))):
                kwargs["run_id"] = link["run_id"]
            else:
                log.info("resume_from: the checkpoint's MLflow run is in %s, this run logs to %s: starting a new run",
                         redact_text(str(link.get("tracking_uri"))), redact_text(str(uri)))
        loggers.append(build(node, **kwargs))
    return loggers


def _start_tracking(loggers: List[Any], cfg: DictConfig, data_stats: Dict[str, Any], out: Path,
                    resume: Optional[Dict[str, Any]]) -> None:
    if process_rank() != 0:  # the other processes' loggers log nothing (Lightning's rank-zero rule)
        return
    for lg in loggers:
        lg.log_hyperparams(_flat_params(cfg))
        if type(lg).__name__.endswith("MLFlowLogger"):
            if not getattr(lg, "reopened", False):  # a continued run has them (at step 0: not a redone step)
                lg.log_metrics({f"data/{k}": float(v) for k, v in data_stats.items()}, step=0)
            if resume:  # the continued run keeps its first config.yaml; this one goes beside it
                lg.experiment.log_text(lg.run_id, (out / "config.yaml").read_text(),
                                       f"config-resumed-at-step-{resume['global_step']}.yaml")
                lg.experiment.set_tag(lg.run_id, "treelit.resumed_from", resume["path"])
            else:
                lg.experiment.log_artifact(lg.run_id, str(out / "config.yaml"))
            lg.experiment.set_tag(lg.run_id, "treelit.output_dir", str(out.resolve()))


def _log_artifacts(loggers: List[Any], out: Path, summary: Dict[str, Any]) -> None:
    """summary.json and the last checkpoint into the MLflow run; a copy that fails for want of
    space is a warning (the files are in ``out``), never a partial artifact."""
    from treelit.lightning.mlflow_logger import log_artifact_checked

    for lg in loggers:
        if type(lg).__name__.endswith("MLFlowLogger"):
            log_artifact_checked(lg.experiment, lg.run_id, out / "summary.json")
            last = summary.get("checkpoint")
            if last and Path(last).is_file():
                log_artifact_checked(lg.experiment, lg.run_id, last, "checkpoints")


class RanksStopped(RuntimeError):
    """A collective failed or timed out during ``fit`` in a run of several processes (another
    process, or a whole node, stopped): reported as one ``error:`` line naming the step."""


@contextmanager
def _ranks_stopped(trainer: Any) -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        if int(getattr(trainer, "world_size", 1)) <= 1 or not any(_collective_failure(e) for e in _chain(exc)):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if not first.startswith("step "):  # outside the training step (a checkpoint, a callback)
            timeout = getattr(getattr(trainer.strategy, "_timeout", None), "total_seconds", lambda: None)()
            first = (f"step {trainer.global_step}, rank {trainer.global_rank} of {trainer.world_size}: a collective "
                     f"failed or timed out - another process stopped (a node lost?) or did not answer within "
                     f"trainer.strategy.timeout_s={timeout:g}s. {type(exc).__name__}: {first}" if timeout else
                     f"step {trainer.global_step}, rank {trainer.global_rank} of {trainer.world_size}: a collective "
                     f"failed - another process stopped (a node lost?). {type(exc).__name__}: {first}")
        raise RanksStopped(first) from exc


@contextmanager
def _agreed_stop(trainer: Any) -> Iterator[None]:
    """A stop every rank agreed on (a non-finite step, preemption; treelit.lightning.faults):
    rank 0 of Lightning's own launcher waits for the processes it started before it reports."""
    from treelit.lightning.faults import exit_code_of, wait_for_launched_ranks

    try:
        yield
    except BaseException as exc:
        if exit_code_of(exc) is not None:
            wait_for_launched_ranks(trainer)
        raise


def _collective_failure(exc: BaseException) -> bool:
    """torch.distributed's own errors, gloo's/NCCL's, and the training step's report of them."""
    import torch.distributed as dist  # cli: treelit-train --help pays for Hydra only

    text = str(exc)
    low = text.lower()
    return (isinstance(exc, getattr(dist, "DistError", ())) or "gloo" in text or "NCCL" in text
            or "Connection reset by peer" in text or "Connection closed by peer" in text
            # gloo's timeout, e.g. in the checkpoint's all-gather: "Application timeout caused pair closure"
            or (isinstance(exc, RuntimeError) and "timeout caused pair closure" in low)
            or (text.startswith("step ") and "a collective failed or timed out" in text))


def _chain(exc: BaseException) -> Iterator[BaseException]:
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def run(cfg: DictConfig) -> Dict[str, Any]:
    """Train as ``cfg`` says and return the summary. The run holds the lock of its
    ``output_dir`` (taken here unless ``treelit-train``'s Hydra callback took it already)
    until it ends; another run on the same folder is refused meanwhile."""
    started = time.monotonic()
    validate_config(cfg)
    out = Path(cfg.output_dir)
    check_writable(out)
    lock = lock_output_dir(out)  # None in processes started by a multi-process launcher
    if lock is not None and lock.took_over:
        log.info("output_dir %s: took over the lock left by %s, which is no longer running", out, lock.took_over)
        lock.took_over = None
    try:
        return _train(cfg, out, started)
    finally:
        if lock is not None:
            lock.release(all=True)  # the run is over, whoever took the lock


def _train(cfg: DictConfig, out: Path, started: float) -> Dict[str, Any]:
    import lightning.pytorch as pl  # heavy (~5 s CPU): only once a run is configured
    from lightning.pytorch.callbacks import ModelCheckpoint  # as above

    from treelit.lightning.callbacks import HFExport
    from treelit.lightning.mlflow_logger import MLflowRunInCheckpoint
    from treelit.builders.vision import check_model_images
    from treelit.models.factory import moe_experts, replay_shape
    from treelit.models.lora import check_lora_mode, check_reference
    from treelit.utils.launchers import shared_run_name  # torch.distributed: not for --help

    preemption = (cfg.get("callbacks") or {}).get("preemption")
    if not preemption:
        startup_signals.uninstall()  # callbacks.preemption=null: the signals are not treelit's
    elif preemption.get("signals") is not None:  # only those it names are treelit's
        startup_signals.keep_only(preemption.get("signals"))
    resume = _resume(cfg, out)
    check_earlier_run(cfg, resume)  # online RL: an earlier run's policy versions or rollouts, before the model
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    if process_rank() == 0:  # one writer: every process of a multi-process run shares the folder
        # resolved, credentials redacted (the loggers receive the real values)
        (out / "config.yaml").write_text(OmegaConf.to_yaml(redact_config(OmegaConf.to_container(cfg, resolve=True))))

    with _setup_errors():
        model = build(cfg.model)
        from treelit.ssm import set_ssm_backend

        set_ssm_backend(model, cfg.ssm.name, cfg.ssm.get("chunk_size", 64))
        hybrid = hybrid_line(model, cfg.ssm.name)
        if hybrid:
            log.info("%s", hybrid)
        if lora_line(model):
            log.info("%s", lora_line(model))
        for line in (routing_line(replay_shape(model)), cp_line(_cp_degree(cfg), world_size(cfg))):
            if line:  # what is on: MoE routing replay, context parallelism
                log.info("%s", line)
        if _cp_degree(cfg) > 1:  # the layer kinds it covers: judged here, before any process starts
            from treelit.partition.context_parallel import check_cp_model

            check_cp_model(model)
        builder = build(cfg.tree_builder)
        datamodule = build(cfg.data, tree_builder=builder)
        objective = build(cfg.objective)
        critic = _build_critic(cfg, model, objective)
        check_reference(model, objective)  # before the data's checks: an option error is the first thing to fix
        check_lora_mode(model, cfg.mode)
        check_model_images(builder, model)  # images and their token against the model's vision tower
        datamodule.check_against(model.tok_embeddings.num_embeddings, getattr(model, "max_seq_len", None),
                                 objective=objective, routing=replay_shape(model), experts=moe_experts(model))
        data_stats = datamodule.stats()
        log.info("data: %s", data_line(data_stats))
        if images_line(data_stats):
            log.info("%s", images_line(data_stats))
        _check_budget(cfg, data_stats)

        module = build_module(cfg, model, objective, critic)
        if getattr(model, "compiled_layers", None) is not None:
            from treelit.models.compiled import compile_line

            log.info("%s", compile_line(model))
        callbacks = _instantiate_all(cfg.get("callbacks"))
        if (cfg.get("publish") or {}).get("dir"):  # online RL: the policy for the sampler (treelit.lightning.publish)
            callbacks.append(build(cfg.publish))
            callbacks[-1].publisher.check(model)  # publish.lora=adapter needs LoRA on a transformers model
        loggers = _build_loggers(cfg.get("logger"), resume)
    tidy_library_logging()
    if loggers:
        callbacks.append(MLflowRunInCheckpoint())
    check_space(out, model, next((c for c in callbacks if isinstance(c, ModelCheckpoint)), None),
                int(cfg.trainer.max_steps), any(isinstance(c, HFExport) for c in callbacks), bool(loggers))
    trainer = build(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    try:
        _start_tracking(loggers, cfg, data_stats, out, resume)
    except BaseException:
        for lg in loggers:
            lg.finalize("failed")
        raise
    with _torch_threads(cfg.get("torch_threads", "auto"), model, str(cfg.trainer.get("accelerator", "cpu"))), \
            warnings.catch_warnings():
        if resume:  # resumed in its own folder, the run finds its earlier checkpoints there: expected
            warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
        # the processes Lightning's launcher starts during fit compose this run's name (one output folder)
        with shared_run_name(LAST_RUN_NAME[0] if LAST_RUN_NAME else None), _ranks_stopped(trainer), \
                _agreed_stop(trainer):
            trainer.fit(module, datamodule=datamodule, ckpt_path=resume["path"] if resume else None,
                        weights_only=True)  # no code from it
    startup_signals.uninstall()  # after training: the signals' default action again

    from treelit.cli.summary import build_summary, format_summary

    summary = build_summary(out=out, trainer=trainer, data_stats=data_stats,
                            wall_seconds=time.monotonic() - started, resume=resume)
    if trainer.is_global_zero:  # one summary.json: the other ranks of a multi-process run hold no MLflow run
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        _log_artifacts(loggers, out, summary)
        log.info("%s", format_summary(summary))
    return summary


def build_module(cfg: DictConfig, model: Any, objective: Any, critic: Any = None) -> Any:
    """The training module of the run ``cfg`` describes, on a built model, objective and critic."""
    from treelit.lightning.module import TreeLitModule

    return TreeLitModule(
        model=model,
        objective=objective,
        optimizer=build(cfg.optimizer),
        scheduler=build(cfg.scheduler) if cfg.get("scheduler") else None,
        attention=build(cfg.attention),
        aggregation=cfg.aggregation,
        mode=cfg.mode,
        grad_clip=cfg.grad_clip,
        verify_every=cfg.verify_every,
        chunk_rows=cfg.chunk_rows,
        ppo_epochs=cfg.ppo_epochs,
        ppo_minibatches=cfg.ppo_minibatches,
        old_logprobs=cfg.old_logprobs,
        partition=cfg.partition.name,
        budget_tokens=cfg.partition.get("budget_tokens"),
        on_nonfinite=cfg.get("on_nonfinite", "stop"),
        max_skipped_steps=cfg.get("max_skipped_steps", 10),
        critic=critic,
        compile=cfg.get("compile", False),
    )


def _fault_exit_code(exc: BaseException) -> Optional[int]:
    """The exit code of a stop the ranks agreed on (treelit.lightning.faults), else None."""
    if isinstance(exc, StartupPreempted):
        return exc.exit_code
    faults = sys.modules.get("treelit.lightning.faults")  # imported by any run that could raise one
    return faults.exit_code_of(exc) if faults is not None else None


# HYDRA_FULL_ERROR as the user set it: main() sets it to 1 while Hydra composes the config (so
# Hydra raises its errors instead of printing them), the task restores it
_USER_FULL_ERROR = "HYDRA_FULL_ERROR_USER"


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    os.environ["HYDRA_FULL_ERROR"] = os.environ.pop(_USER_FULL_ERROR, os.environ.get("HYDRA_FULL_ERROR", "0"))
    try:
        if "hf_adapter" in str(cfg.model.get("_target_", "")):  # transformers' model code: its bars are noise
            quiet_transformers_bars()
        run(cfg)
    except BaseException as exc:
        code = _fault_exit_code(exc)
        if code is not None and not full_error_requested():  # every rank knows it: one line, from rank 0
            log.log(logging.ERROR if process_rank() == 0 else logging.INFO, "%s", exc)
            sys.exit(code)
        if not isinstance(exc, Exception):
            raise
        msg = str(exc) if isinstance(exc, RanksStopped) else user_error_message(exc)
        if msg is None or full_error_requested():
            raise
        log.error("%s", msg)  # one line; HYDRA_FULL_ERROR=1 shows the traceback (docs: Training)
        sys.exit(1)


def _cp_degree(cfg: DictConfig) -> int:
    strategy = (cfg.get("trainer") or {}).get("strategy")
    cp = strategy.get("context_parallel_degree", 1) if hasattr(strategy, "get") else 1
    return cp if isinstance(cp, int) else 1


def _build_critic(cfg: DictConfig, model, objective):
    """``critic=shared|separate``: the value function (None with ``critic=none``). The objective
    learns that advantages come from GAE (its data needs: rewards, not advantages)."""
    c = cfg.get("critic") or {}
    kind = c.get("kind", "none")
    if kind in (None, "none"):
        return None
    import torch  # cli: built once a run is configured

    from treelit.cli.config import critic_model_config
    from treelit.models.critic import Critic
    from treelit.models.forward import output_weight

    trunk = None
    if kind == "separate":
        from treelit.ssm import set_ssm_backend

        trunk = build(critic_model_config(cfg))
        set_ssm_backend(trunk, cfg.ssm.name, cfg.ssm.get("chunk_size", 64))
    ref = output_weight(trunk if trunk is not None else model)
    dtype = ref.dtype if ref.dtype in (torch.float32, torch.float64) else torch.float32
    critic = Critic(kind, int(ref.shape[1]), trunk, vf_coef=c.get("vf_coef"), value_clip=c.get("value_clip"),
                    lr=c.get("lr"), dtype=dtype)
    objective.critic = kind
    log.info("critic: %s (%s), vf_coef %s, value_clip %s, GAE gamma %s lam %s", kind,
             "a value head on the policy's trunk" if trunk is None else
             f"its own model, {sum(p.numel() for p in critic.parameters()) / 1e6:.2f}M parameters",
             critic.vf_coef, critic.value_clip, objective.gamma, objective.lam)
    return critic


def hybrid_line(model, ssm: str) -> str:
    """What runs a transformers hybrid checkpoint's recurrent layers, in one console line ("" for
    other models): they are transformers' own layers with their kernels swapped for treelit's tree
    versions, which nothing else in the output would show."""
    layers = [m for m in model.modules() if hasattr(m, "_treelit_forward")]
    if not layers:
        return ""
    kinds = sorted({type(m).__name__ for m in layers})
    kernels = sorted({k for m in layers for k in m._treelit_kernels if k in _SEQUENCE_KERNELS})
    return (f"model: {len(layers)} recurrent layer(s) ({', '.join(kinds)}) run through treelit's tree kernels "
            f"({', '.join(kernels)}; ssm={ssm}): each segment starts from its parent segment's state")


def lora_line(model) -> str:
    """The LoRA adapters in one console line ("" without them): rank, where, what trains."""
    opts = getattr(model, "treelit_lora", None)
    if opts is None:
        return ""
    wrapped = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                      if hasattr(m, "lora_A") and hasattr(m, "base_layer")})
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    saved = f", modules_to_save {', '.join(opts['modules_to_save'])}" if opts["modules_to_save"] else ""
    return (f"lora: rank {opts['rank']}, alpha {opts['alpha']:g} on {', '.join(wrapped)}{saved}: "
            f"{trained:,} trained parameters of {total:,} ({100.0 * trained / max(total, 1):.2f}%); the base is frozen")


_SEQUENCE_KERNELS = {"causal_conv1d_fn", "chunk_gated_delta_rule", "chunk_kda", "mamba_chunk_scan_combined"}


def main() -> None:
    """``treelit-train``. A mistake on the command line (an unknown option of a config group,
    an unknown key) is one ``error:`` line with the closest names, not Hydra's dump. A
    preemption signal before training starts is one line and exit code 75
    (:mod:`treelit.cli.startup_signals`)."""
    startup_signals.install()
    startup_signals.running()
    register_resolvers()
    user = os.environ.get("HYDRA_FULL_ERROR", "0")
    os.environ[_USER_FULL_ERROR] = user
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        _hydra_main()
    except StartupPreempted as exc:  # before Hydra set up the console
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except Exception as exc:  # raised before the task ran (composing the config, Hydra's callbacks)
        msg = hydra_error_message(exc) or user_error_message(exc)
        if msg is None or user == "1":
            raise
        print(f"error: {redact_text(msg)}", file=sys.stderr)  # an override as typed may hold a password
        sys.exit(1)
    finally:
        startup_signals.uninstall()
        os.environ.pop(_USER_FULL_ERROR, None)
        os.environ["HYDRA_FULL_ERROR"] = user


if __name__ == "__main__":
    main()
