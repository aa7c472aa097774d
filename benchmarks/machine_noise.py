"""How much this machine's speed drifts: the same fixed piece of work, timed again and again.

Times one matrix product of a benchmark-sized MLP block (``[2048, 512] @ [512, 2816]``,
ten times) every ``--every`` seconds, as this process's CPU time on one thread, and prints
each sample and their spread. On a machine to itself every sample would take the same
time; a spread of tens of percent means that one step of a few seconds is a poor sample
of the machine's speed, which is why ``bench_step.py`` runs several tree steps around
each per-branch step (``--tree-steps``).

    python benchmarks/machine_noise.py --samples 40
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch


def sample(a: torch.Tensor, b: torch.Tensor, repeat: int) -> float:
    t0 = time.process_time()
    for _ in range(repeat):
        torch.mm(a, b)
    return time.process_time() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--every", type=float, default=0.5, help="seconds of pause between samples")
    p.add_argument("--repeat", type=int, default=10, help="matrix products per sample")
    p.add_argument("--json", help="write the samples here")
    args = p.parse_args(argv)
    if args.samples < 2:
        p.error("--samples must be >= 2")
    torch.set_num_threads(1)
    a, b = torch.randn(2048, 512), torch.randn(512, 2816)
    sample(a, b, 1)  # warm-up
    times = []
    for _ in range(args.samples):
        times.append(sample(a, b, args.repeat))
        time.sleep(args.every)
    med = statistics.median(times)
    print("samples (ms): " + " ".join(f"{t * 1e3:.0f}" for t in times))
    print(f"median {med * 1e3:.0f} ms, min {min(times) * 1e3:.0f}, max {max(times) * 1e3:.0f}: "
          f"{(min(times) / med - 1) * 100:+.0f}% / {(max(times) / med - 1) * 100:+.0f}% of the median; "
          f"load {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"samples_s": times, "median_s": med, "command": " ".join(["python", *sys.argv])}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
