"""A local stand-in for SLURM's ``sbatch`` and ``srun``, for the recipe tests: a job's "nodes" are
all this machine, and its tasks are local processes with the environment SLURM gives them.

``install(bin_dir)`` writes ``sbatch`` and ``srun`` executables into ``bin_dir``; put it first on
``PATH``.

* ``sbatch [options] SCRIPT [ARGS...]`` reads the script's ``#SBATCH`` directives (those before
  its first command) and then the command line's options (which win), makes up a job id, prints
  ``Submitted batch job <id>`` and runs ``bash SCRIPT ARGS...`` in the submission directory (or
  ``--chdir``) with the batch step's variables (``SLURM_JOB_ID``, ``SLURM_JOB_NAME``,
  ``SLURM_JOB_NUM_NODES`` / ``SLURM_NNODES``, ``SLURM_NTASKS``, ``SLURM_NTASKS_PER_NODE``,
  ``SLURM_CPUS_PER_TASK``, ``SLURM_JOB_NODELIST`` / ``SLURM_NODELIST``, ``SLURM_SUBMIT_DIR``, ...),
  its output into ``--output`` (default ``slurm-%j.out``; ``%j`` job id, ``%x`` job name). With
  ``--wait`` it returns when the job ends, with the job's exit status; otherwise at once.
* ``srun [options] COMMAND...``, inside such a job, starts one process per task, blocks of
  ``--ntasks-per-node`` consecutive tasks per node (SLURM's default distribution), each with
  ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURMD_NODENAME`` and the step's
  variables, their output on srun's; exits with the highest exit status. ``--kill-on-bad-exit=1``
  (``-K``) stops the other tasks when one fails.

The job id is one whose port under Lightning's rule for SLURM jobs (its last four digits +
15000) is free here. The node list is ``localhost`` (every node's name resolves to this machine),
or ``SLURM_STANDIN_NODELIST`` when set. Options that the stand-in does not know are refused, and so
is a request for GPUs.

Not simulated: the scheduler itself (queueing, limits, accounting), requeue, ``scancel``,
``squeue``, heterogeneous jobs, node names that are different hosts.
"""

from __future__ import annotations

import os
import random
import re
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

# option name -> canonical name; a value of None: a flag without argument
_SBATCH = {"-N": "nodes", "--nodes": "nodes", "-n": "ntasks", "--ntasks": "ntasks",
           "--ntasks-per-node": "ntasks-per-node", "-c": "cpus-per-task", "--cpus-per-task": "cpus-per-task",
           "-J": "job-name", "--job-name": "job-name", "-o": "output", "--output": "output",
           "-e": "error", "--error": "error", "-D": "chdir", "--chdir": "chdir", "-t": "time", "--time": "time",
           "-p": "partition", "--partition": "partition", "-A": "account", "--account": "account",
           "--mem": "mem", "--gpus-per-node": "gpus-per-node", "-G": "gpus", "--gpus": "gpus",
           "--gres": "gres", "--export": "export"}
_SBATCH_FLAGS = {"-W": "wait", "--wait": "wait", "--exclusive": "exclusive", "--requeue": "requeue",
                 "--no-requeue": "no-requeue"}
_SRUN = {"-N": "nodes", "--nodes": "nodes", "-n": "ntasks", "--ntasks": "ntasks",
         "--ntasks-per-node": "ntasks-per-node", "-c": "cpus-per-task", "--cpus-per-task": "cpus-per-task",
         "-J": "job-name", "--job-name": "job-name", "--cpu-bind": "cpu-bind", "--mpi": "mpi", "--export": "export"}
_SRUN_FLAGS = {"-K": "kill-on-bad-exit", "--kill-on-bad-exit": "kill-on-bad-exit"}


class StandinError(Exception):
    pass


def _parse(argv: List[str], valued: Dict[str, str], flags: Dict[str, str], prog: str) -> Tuple[Dict[str, str], List[str]]:
    """Options up to the first positional argument; the rest is returned untouched."""
    opts: Dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        arg = argv[i]
        name, eq, value = arg.partition("=") if arg.startswith("--") else (arg[:2], "", arg[2:])
        if name in flags and not value:
            opts[flags[name]] = "1"
        elif name in valued:
            if not value and not eq:
                i += 1
                if i >= len(argv):
                    raise StandinError(f"{prog}: option {name} needs a value")
                value = argv[i]
            opts[valued[name]] = value
        elif name in flags:  # --kill-on-bad-exit=1
            opts[flags[name]] = value
        else:
            raise StandinError(f"{prog}: the SLURM stand-in does not know the option {arg!r}")
        i += 1
    return opts, argv[i:]


def _directives(script: Path) -> List[str]:
    """The ``#SBATCH`` options of a script, read as sbatch does: up to its first command."""
    out = []
    for line in script.read_text().splitlines()[1:]:
        s = line.strip()
        if s.startswith("#SBATCH"):
            out += shlex.split(s[len("#SBATCH"):], comments=True)
        elif s and not s.startswith("#"):
            break
    return out


def _free_job_id() -> str:
    for _ in range(500):
        suffix = random.randrange(1000, 10000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 15000 + suffix))
            except OSError:
                continue
        return f"{random.randrange(1, 10)}{suffix:04d}"
    raise StandinError("sbatch: no free port in 16000-24999 for a job id")


def _counts(opts: Dict[str, str], prog: str) -> Tuple[int, int, Optional[int]]:
    """(nodes, tasks, tasks per node or None) from the options."""
    nodes = int(opts.get("nodes", "1").split("-")[0])
    per_node = int(opts["ntasks-per-node"]) if "ntasks-per-node" in opts else None
    tasks = int(opts["ntasks"]) if "ntasks" in opts else nodes * (per_node or 1)
    if per_node is not None and tasks != nodes * per_node:
        raise StandinError(f"{prog}: --ntasks={tasks} is not --nodes={nodes} x --ntasks-per-node={per_node}")
    if tasks < nodes:
        raise StandinError(f"{prog}: --ntasks={tasks} is fewer than --nodes={nodes}")
    return nodes, tasks, per_node


def sbatch(argv: List[str]) -> int:
    opts, rest = _parse(argv, _SBATCH, _SBATCH_FLAGS, "sbatch")
    if not rest:
        raise StandinError("sbatch: no batch script given")
    script, args = Path(rest[0]), rest[1:]
    if not script.is_file():
        raise StandinError(f"sbatch: error: Unable to open file {script}")
    opts = {**_parse(_directives(script), _SBATCH, _SBATCH_FLAGS, "sbatch (#SBATCH)")[0], **opts}
    for gpu in ("gpus-per-node", "gpus", "gres"):
        if opts.get(gpu) not in (None, "0", "none"):
            raise StandinError(f"sbatch: the SLURM stand-in has no GPUs (--{gpu}={opts[gpu]})")
    if opts.get("export", "ALL") != "ALL":
        raise StandinError("sbatch: the SLURM stand-in exports the whole environment only (--export=ALL)")
    nodes, tasks, per_node = _counts(opts, "sbatch")
    job_id, name = _free_job_id(), opts.get("job-name", script.name)
    submit = Path.cwd()
    workdir = Path(opts.get("chdir", str(submit)))
    nodelist = os.environ.get("SLURM_STANDIN_NODELIST", "localhost")
    cpus = int(opts.get("cpus-per-task", "1"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}
    env.update(SLURM_JOB_ID=job_id, SLURM_JOBID=job_id, SLURM_JOB_NAME=name, SLURM_SUBMIT_DIR=str(submit),
               SLURM_SUBMIT_HOST=socket.gethostname(), SLURM_CLUSTER_NAME="standin",
               SLURM_JOB_NUM_NODES=str(nodes), SLURM_NNODES=str(nodes), SLURM_NTASKS=str(tasks),
               SLURM_NPROCS=str(tasks), SLURM_JOB_NODELIST=nodelist, SLURM_NODELIST=nodelist,
               SLURM_NODEID="0", SLURM_PROCID="0", SLURM_LOCALID="0", SLURMD_NODENAME=nodelist.split(",")[0],
               SLURM_CPUS_ON_NODE=str(cpus * (per_node or tasks // nodes)),
               SLURM_JOB_CPUS_PER_NODE=str(cpus * (per_node or tasks // nodes)),
               SLURM_TASKS_PER_NODE=f"{per_node or tasks // nodes}(x{nodes})")
    if per_node is not None:
        env["SLURM_NTASKS_PER_NODE"] = str(per_node)
    if "cpus-per-task" in opts:
        env["SLURM_CPUS_PER_TASK"] = opts["cpus-per-task"]

    def expand(pattern: str) -> Path:
        text = re.sub(r"%(.)", lambda m: {"j": job_id, "J": job_id, "x": name, "u": os.environ.get("USER", "user"),
                                         "N": env["SLURMD_NODENAME"], "%": "%"}.get(m.group(1), m.group(0)), pattern)
        return workdir / text

    out_path = expand(opts.get("output", "slurm-%j.out"))
    err_path = expand(opts["error"]) if "error" in opts else None
    print(f"Submitted batch job {job_id}", flush=True)
    out = open(out_path, "w")
    err = open(err_path, "w") if err_path else subprocess.STDOUT
    proc = subprocess.Popen(["bash", str(script.resolve()), *args], cwd=workdir, env=env, stdout=out, stderr=err,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    if "wait" not in opts:
        return 0
    try:
        rc = proc.wait()
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        rc = proc.wait()
    if rc != 0:
        print(f"sbatch: job {job_id} ended with exit status {rc} (its output: {out_path})", file=sys.stderr)
    return rc


def srun(argv: List[str]) -> int:
    if "SLURM_JOB_ID" not in os.environ:
        raise StandinError("srun: the SLURM stand-in runs srun inside a job only (a script given to sbatch)")
    opts, cmd = _parse(argv, _SRUN, _SRUN_FLAGS, "srun")
    if not cmd:
        raise StandinError("srun: no command given")
    job = os.environ
    alloc = {"nodes": job["SLURM_JOB_NUM_NODES"]}
    if "ntasks" not in opts and "ntasks-per-node" not in opts:
        alloc["ntasks"] = job["SLURM_NTASKS"]
        if "SLURM_NTASKS_PER_NODE" in job:
            alloc["ntasks-per-node"] = job["SLURM_NTASKS_PER_NODE"]
    nodes, tasks, per_node = _counts({**alloc, **opts}, "srun")
    if nodes > int(job["SLURM_JOB_NUM_NODES"]) or tasks > int(job["SLURM_NTASKS"]):
        raise StandinError(f"srun: {tasks} tasks on {nodes} nodes is more than the job's allocation")
    block = per_node or -(-tasks // nodes)
    kill_on_bad_exit = opts.get("kill-on-bad-exit", "0") not in ("0", "")
    nodelist = job.get("SLURM_JOB_NODELIST", "localhost")
    procs = []
    for rank in range(tasks):
        node = rank // block
        env = dict(job)
        env.update(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % block), SLURM_NODEID=str(node),
                   SLURMD_NODENAME=nodelist.split(",")[min(node, len(nodelist.split(",")) - 1)],
                   SLURM_STEP_ID="0", SLURM_STEPID="0", SLURM_STEP_NUM_TASKS=str(tasks),
                   SLURM_STEP_NUM_NODES=str(nodes), SLURM_STEP_NODELIST=nodelist, SLURM_NTASKS=str(tasks),
                   SLURM_NPROCS=str(tasks), SLURM_NNODES=str(nodes), SLURM_STEP_TASKS_PER_NODE=f"{block}(x{nodes})",
                   SLURM_TASKS_PER_NODE=f"{block}(x{nodes})", SLURM_LAUNCH_NODE_IPADDR="127.0.0.1",
                   SLURM_SRUN_COMM_HOST="127.0.0.1")
        if per_node is not None:
            env["SLURM_NTASKS_PER_NODE"] = str(per_node)
        if "cpus-per-task" in opts:
            env["SLURM_CPUS_PER_TASK"] = opts["cpus-per-task"]
        procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True))

    def stop(sig=signal.SIGTERM):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    codes: Dict[int, int] = {}
    try:
        while len(codes) < tasks:
            for rank, p in enumerate(procs):
                if rank not in codes and p.poll() is not None:
                    codes[rank] = p.returncode
                    if p.returncode != 0:
                        how = (f"killed by signal {-p.returncode}" if p.returncode < 0
                               else f"exited with exit code {p.returncode}")
                        print(f"srun: error: task {rank}: {how}", file=sys.stderr, flush=True)
                        if kill_on_bad_exit:
                            stop()
            time.sleep(0.05)
    except KeyboardInterrupt:
        stop()
        raise
    finally:
        if len(codes) < tasks:
            stop(signal.SIGKILL)
    return max((128 - c if c < 0 else c) for c in codes.values()) if codes else 1


def install(bin_dir: Path) -> Path:
    """Write ``sbatch`` and ``srun`` into ``bin_dir`` (run by this Python, this module); the folder."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    here = Path(__file__).resolve().parent
    for name in ("sbatch", "srun"):
        exe = bin_dir / name
        exe.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(here)!r})\n"
                       f"from slurm_standin import main\nsys.exit(main({name!r}, sys.argv[1:]))\n")
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return bin_dir


def main(prog: str, argv: List[str]) -> int:
    try:
        return sbatch(argv) if prog == "sbatch" else srun(argv)
    except (StandinError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 1
