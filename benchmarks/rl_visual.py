"""The closed online RL loop on a visual task: a tiny vision-language model learns to name the colour
of the square in its prompt's picture, with ``treelit-train`` and ``treelit-rollout`` as two
processes on CPU.

    python benchmarks/rl_visual.py --table benchmarks/results/rl_visual.json --plot docs/img/rl_visual_reward.png
    python benchmarks/rl_visual.py --steps 2 --quick      # a smoke run (the default suite's)

The first takes about 3 min on 2 shared CPU cores (100 steps).

The task (:mod:`treelit.rl.visual_task`): 16 pictures of 16x16 pixels, each a grey background with
a square of one of four colours at a random place; the prompt is ``ASK <image> QUESTION`` (one
image token, 4 placeholder tokens once processed), the answer one token naming the colour; the
reward ``square_colour`` reads the colour from the image's pixels, 1 for the right token, else 0.
The model: a random Qwen2.5-VL with tiny parts (a 2-block tower with 4-pixel patches and merge
size 2, a 2-layer language model over a 24-token vocabulary), saved as a Hugging Face checkpoint
with its image processor, loaded by the trainer as ``model=hf_auto model.vision=true``.

The loop: ``experiment=rl_online`` (GRPO, ``old_logprobs=rollout``, truncated importance sampling,
one policy version published per step, learning rate 3e-3) on that checkpoint, and ``treelit-rollout
--reward square_colour --n 16 --max-new-tokens 1 --max-staleness 1`` sampling every prompt each step. The
mean reward of each rollout file (against the policy version it was sampled from) goes to a JSON
table (``--table``), a Markdown table on stdout, and a plot (``--plot``, when matplotlib is there).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
IMAGE, VIDEO, START, END = 20, 21, 22, 23  # the checkpoint's image tokens (the task's text tokens are below 20)
VOCAB = 24


def make_checkpoint(path: Path, seed: int = 0) -> Path:
    """A random tiny Qwen2.5-VL checkpoint (float32) with its image processor, at ``path``."""
    import torch
    import transformers

    rope = {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0}
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=2, max_position_embeddings=256, head_dim=8, rope_parameters=rope,
                tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    vision = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=32, window_size=16, fullatt_block_indexes=[1])
    cfg = transformers.AutoConfig.for_model("qwen2_5_vl", text_config=text, vision_config=vision,
                                            image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
                                            vision_end_token_id=END, bos_token_id=None, eos_token_id=None,
                                            pad_token_id=None)
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path)
    transformers.Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64,
                                          max_pixels=32 * 32).save_pretrained(path)
    return path


def commands(work: Path, ckpt: Path, prompts: Path, steps: int, n: int, lr: float) -> Dict[str, List[str]]:
    rl = work / "rl"
    train = [str(Path(sys.executable).with_name("treelit-train")), "experiment=rl_online", f"rl_dir={rl}",
             "model=hf_auto", "~model.config", f"model.hf_checkpoint={ckpt}", "model.vision=true",
             f"tree_builder.processor_path={ckpt}", f"optimizer.lr={lr}", f"trainer.max_steps={steps}",
             "logger=none", "trainer.enable_progress_bar=false", "callbacks.progress=null", "callbacks.checkpoint=null",
             f"output_dir={work / 'run'}"]
    sample = [sys.executable, "-m", "treelit.cli.rollout", "--publish-dir", str(rl / "policy"), "--out",
              str(rl / "rollouts"), "--prompts", str(prompts), "--reward", "square_colour", "--n", str(n),
              "--max-new-tokens", "1", "--steps", str(steps), "--max-staleness", "1"]
    return {"train": train, "sample": sample}


def run_loop(work: Path, steps: int, n: int = 16, prompts: int = 16, lr: float = 3e-3, seed: int = 0,
             timeout_s: float = 900) -> Dict[str, Any]:
    """Build the checkpoint and the prompts in ``work``, run both processes to the end; the
    per-step rows of the worker's log (step, policy version, mean reward) and the seconds taken."""
    sys.path.insert(0, str(ROOT / "src"))
    from treelit.rl.visual_task import write_prompts

    work.mkdir(parents=True, exist_ok=True)
    ckpt = make_checkpoint(work / "ckpt", seed)
    pfile = write_prompts(work / "task", prompts, IMAGE, START, END, seed=seed)
    cmd = commands(work, ckpt, pfile, steps, n, lr)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    logs = {k: open(work / f"{k}.log", "w") for k in cmd}
    t0 = time.monotonic()
    procs = {k: subprocess.Popen(c, cwd=work, env=env, stdout=logs[k], stderr=subprocess.STDOUT)
             for k, c in cmd.items()}
    try:
        for k, p in procs.items():
            rc = p.wait(timeout=max(1.0, timeout_s - (time.monotonic() - t0)))
            if rc != 0:
                raise RuntimeError(f"{k} exited {rc}: {(work / f'{k}.log').read_text()[-3000:]}")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        for f in logs.values():
            f.close()
    rows = [json.loads(line) for line in (work / "sample.log").read_text().splitlines() if line.startswith("{")]
    shown = {k: [Path(c[0]).name] + [x.replace(str(work), "WORK") for x in c[1:]] for k, c in cmd.items()}
    return {"rows": [{"step": r["step"], "policy_version": r["policy_version"], "reward": r["reward_mean"]}
                     for r in rows],
            "seconds": round(time.monotonic() - t0, 1), "commands": shown, "rollouts": str(work / "rl" / "rollouts")}


def table(rows: List[Dict[str, Any]]) -> str:
    lines = ["| step | policy version | mean reward |", "|---:|---:|---:|"]
    lines += [f"| {r['step']} | {r['policy_version']} | {r['reward']:.3f} |" for r in rows]
    return "\n".join(lines)


def plot(rows: List[Dict[str, Any]], path: Path, title: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot([r["policy_version"] for r in rows], [r["reward"] for r in rows], "o-", ms=3)
    ax.set_xlabel("policy version the file was sampled from")
    ax.set_ylabel("mean reward of the file")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="training steps (rollout files)")
    ap.add_argument("--n", type=int, default=16, help="completions per prompt")
    ap.add_argument("--prompts", type=int, default=16, help="pictures (prompts per file)")
    ap.add_argument("--lr", type=float, default=3e-3, help="the trainer's learning rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="where the run's files go (default: a temporary folder)")
    ap.add_argument("--table", default=None, help="write the results (rows, seconds, commands) as JSON here")
    ap.add_argument("--plot", default=None, help="write the reward curve as a PNG here")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 4 prompts, 4 completions")
    a = ap.parse_args(argv)
    if a.quick:
        a.prompts, a.n = 4, 4
    with tempfile.TemporaryDirectory() as tmp:
        res = run_loop(Path(a.workdir or tmp), a.steps, a.n, a.prompts, a.lr, a.seed)
    res["command"] = "python benchmarks/rl_visual.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))
    print(table(res["rows"]))
    print(f"{len(res['rows'])} steps in {res['seconds']} s")
    if a.table:
        Path(a.table).write_text(json.dumps({k: v for k, v in res.items() if k != "rollouts"}, indent=1) + "\n")
    if a.plot and not plot(res["rows"], Path(a.plot), f"closed loop, square colour: {a.prompts} pictures x {a.n}"):
        print("matplotlib is not installed: no plot (the table above)")


if __name__ == "__main__":
    main()
