"""The closed online loop on the synthetic visual task (``benchmarks/rl_visual.py``): ``treelit-train``
on a tiny vision-language checkpoint and ``treelit-rollout`` with image prompts, as processes.
The smoke run checks the files and that each reward is the image's; the learning run (slow) that
the mean reward rises."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "rl_visual.py"


def bench():
    spec = importlib.util.spec_from_file_location("rl_visual", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_short_run_writes_image_rollouts_scored_from_their_images(tmp_path, capsys):
    from PIL import Image

    from treelit.rl.visual_task import ANSWER_TOKENS, colour_token

    work = tmp_path / "work"
    table, png = tmp_path / "rl_visual.json", tmp_path / "rl_visual.png"
    bench().main(["--steps", "2", "--quick", "--workdir", str(work), "--table", str(table), "--plot", str(png)])
    out = capsys.readouterr().out
    assert "| step | policy version | mean reward |" in out and "2 steps in" in out
    res = json.loads(table.read_text())
    assert [r["step"] for r in res["rows"]] == [0, 1] and png.stat().st_size > 0
    assert res["command"].startswith("python benchmarks/rl_visual.py --steps 2")
    rollouts = work / "rl" / "rollouts"
    files = sorted(rollouts.glob("step-*.jsonl*"))
    assert [f.name for f in files] == ["step-000000.jsonl.consumed", "step-000001.jsonl.consumed"]  # both trained
    seen, right = set(), 0
    for f in files:
        for rec in (json.loads(line) for line in f.read_text().splitlines()):
            assert len(rec["branches"]) == 4
            for br in rec["branches"]:
                (ref,) = br["images"]
                path = rollouts / ref
                assert ref.startswith("images/") and path.is_file()  # inside the rollout folder
                want = colour_token(Image.open(path))
                assert want in ANSWER_TOKENS.values()
                assert br["reward"] == float(br["input_ids"][-1] == want)  # the image's colour, nothing else
                seen.add(want)
                right += br["reward"] == 1.0
    assert len(seen) == 4  # four pictures, one of each colour
    assert [r["reward"] for r in res["rows"]] == [
        sum(b["reward"] for line in f.read_text().splitlines() for b in json.loads(line)["branches"]) / 16
        for f in files]


@pytest.mark.slow
def test_the_loop_learns_to_name_the_colour(tmp_path):
    """The documented run (docs/streaming.md, "Images in the loop"): the mean reward of the last
    ten files is far above the first ten's."""
    rows = bench().run_loop(tmp_path / "work", steps=100, n=16, lr=3e-3)["rows"]
    first = sum(r["reward"] for r in rows[:10]) / 10
    last = sum(r["reward"] for r in rows[-10:]) / 10
    print(f"mean reward: first ten files {first:.3f}, last ten {last:.3f}")
    assert len(rows) == 100 and first < 0.3 and last > first + 0.4, (first, last)
