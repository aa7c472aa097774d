"""``treelit-rollout`` on a vision-language policy: image prompts (raw and chat), the images written
into the rollout folder in the trainer's record format, log-probs the published model's own (the
image placeholders never sampled), the file read back by the trainer's builder and trained on;
a bad image in a prompt is one line naming file:line."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

import treelit
from treelit.cli.rollout import _args, main, run
from treelit.lightning.publish import PolicyPublisher
from vision_oracle import END, IMAGE, START, VIDEO, image_processor, png_bytes, random_image, vision_checkpoint

pytest.importorskip("transformers")


def _publish(root, family):
    """A tiny checkpoint of ``family`` with its image processor, published as version 0 (float64)."""
    ckpt = vision_checkpoint(root / "ckpt", family)
    image_processor().save_pretrained(ckpt)
    model = treelit.load_hf_model(ckpt, dtype=torch.float64, vision=True)
    PolicyPublisher(root / "policy", dtype="float64", tokenizer=str(ckpt)).publish(model, 0)
    return root, ckpt, model


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return _publish(tmp_path_factory.mktemp("vlpolicy"), "qwen2_5_vl")


def _prompts(folder, bad=None):
    (folder / "pics").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    random_image(rng, 16, 24).save(folder / "pics" / "a.png")
    uri = "data:image/png;base64," + base64.b64encode(png_bytes(random_image(rng, 16, 16))).decode()
    recs = [{"id": "a", "input_ids": [1, START, IMAGE, END, 2], "images": ["pics/a.png"], "answer": 3},
            bad or {"id": "b", "input_ids": [4, START, IMAGE, END, START, IMAGE, END], "images": [uri, "pics/a.png"]}]
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


SEEN = []


def looks(prompt_ids, completion_ids, images=None, **record):
    SEEN.append((list(prompt_ids), [im.size for im in images], record))
    bright = np.asarray(images[0]).mean() > 127
    return sum(t % 2 == bright for t in completion_ids) / len(completion_ids)


def _worker(root, prompts, out, *more):
    return ["--publish-dir", str(root / "policy"), "--prompts", str(prompts), "--out", str(out), "--n", "3",
            "--max-new-tokens", "3", "--reward", f"{__name__}:looks", "--steps", "1", "--timeout-s", "1",
            "--dtype", "float64", *more]


def _logprobs(ref, ids, shown):
    """Per-token log-probs of a compact branch through transformers, its images expanded (the
    placeholders' probability set to zero, as the sampler draws)."""
    proc = image_processor()
    outs = [proc(images=[im], return_tensors="pt") for im in shown]
    full, k = [], 0
    for t in ids:
        if t == IMAGE:
            full += [IMAGE] * (int(outs[k]["image_grid_thw"].prod()) // 4)
            k += 1
        else:
            full.append(t)
    x = torch.tensor([full])
    ref.model.rope_deltas = None
    with torch.no_grad():
        logits = ref(input_ids=x, pixel_values=torch.cat([o["pixel_values"] for o in outs]).double(),
                     image_grid_thw=torch.cat([o["image_grid_thw"] for o in outs]),
                     mm_token_type_ids=(x == IMAGE).int()).logits[0].double()
    logits[:, [IMAGE, VIDEO]] = float("-inf")
    lp = torch.log_softmax(logits, -1)[:-1].gather(1, x[0, 1:, None])[:, 0]
    return lp, len(full) - len(ids)


@pytest.mark.parametrize("family", ["qwen2_5_vl", *(pytest.param(f, marks=pytest.mark.slow)
                                                    for f in ("qwen3_vl", "qwen3_5", "qwen3_vl_moe"))])
def test_image_prompts_roll_out_into_files_the_trainer_reads_and_trains_on(family, request, tmp_path):
    from PIL import Image

    from treelit.builders.assemble import Limits
    from treelit.builders.groups import GroupsBuilder
    from treelit.lightning.data import build_trees
    from treelit.objectives import make_objective
    from vision_oracle import load_reference

    root, ckpt, model = (request.getfixturevalue("policy") if family == "qwen2_5_vl"
                         else _publish(tmp_path, family))
    assert (root / "policy" / "step-0" / "preprocessor_config.json").is_file()  # published with the weights
    prompts, out = _prompts(tmp_path), tmp_path / "out"
    SEEN.clear()
    assert run(_args(_worker(root, prompts, out))) == 0
    path = out / "step-000000.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["id"] for r in recs] == ["a@0", "b@0"]
    # the reward saw the decoded images and the compact prompt; the record's other fields as before
    assert SEEN[0] == ([1, START, IMAGE, END, 2], [(24, 16)], {"answer": 3})
    assert SEEN[3][:2] == ([4, START, IMAGE, END, START, IMAGE, END], [(16, 16), (24, 16)])
    a_png = (tmp_path / "pics" / "a.png").read_bytes()
    ref = load_reference(str(ckpt))
    for r, prompt in zip(recs, ([1, START, IMAGE, END, 2], [4, START, IMAGE, END, START, IMAGE, END])):
        for br in r["branches"]:
            P, ids = len(prompt), br["input_ids"]
            assert ids[:P] == prompt and len(ids) == P + 3 and not {IMAGE, VIDEO} & set(ids[P:])
            assert br["loss_mask"] == [0] * P + [1] * 3 and br["old_logprobs"][:P] == [None] * P
            refs = br["images"]
            assert all(x.startswith("images/") and x.endswith(".png") for x in refs)  # inside --out
            files = [out / x for x in refs]
            assert files[-1].read_bytes() == a_png  # the image's own bytes, once per content
            lp, grown = _logprobs(ref, ids, [Image.open(f).convert("RGB") for f in files])
            assert torch.allclose(torch.tensor(br["old_logprobs"][P:], dtype=torch.float64), lp[P + grown - 1:],
                                  atol=1e-9)
    assert len({br["reward"] for br in recs[0]["branches"]}) > 1  # a group with something to learn
    assert len(list((out / "images").iterdir())) == 2  # a.png (in both prompts) and the data: URI image
    # the trainer's builder reads the file back unchanged and one GRPO step trains on it
    builder = GroupsBuilder(advantage="grpo", processor_path=str(ckpt))
    trees = build_trees(str(path), builder, limits=Limits(64, 256, needs={"advantage": True, "old_logprobs": True}))
    assert len(trees) == 2 and all(t.tree.images is not None for t in trees)
    assert trees[1].tree.images.num_images == 2
    ours = treelit.load_hf_model(ckpt, dtype=torch.float64, vision=True)
    before = {n: p.detach().clone() for n, p in ours.named_parameters()}
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    loss = sum(treelit.tree_loss(ours, t.tree, "seq-mean-token-mean", "segment", objective=make_objective("grpo"))
               for t in trees)
    loss.backward()
    opt.step()
    moved = [n for n, p in ours.named_parameters() if not torch.equal(p, before[n])]
    assert any("visual" in n for n in moved) and any("language_model" in n for n in moved)


def test_a_bad_image_in_a_prompt_is_one_line_naming_file_and_line(policy, tmp_path, capsys):
    root = policy[0]
    for bad, says in [({"id": "b", "input_ids": [4, START, IMAGE, END], "images": ["pics/missing.png"]},
                       "images[0]: image 'pics/missing.png' does not exist"),
                      ({"id": "b", "input_ids": [4, START, IMAGE, END], "images": ["../outside.png"]},
                       "images[0]: image '../outside.png' resolves outside"),
                      ({"id": "b", "input_ids": [4, START, IMAGE, END, IMAGE], "images": ["pics/a.png"]},
                       "input_ids: 2 image token(s) 35 for 1 image(s)")]:
        (tmp_path / "outside.png").write_bytes(png_bytes(random_image(np.random.default_rng(0), 8, 8)))
        prompts = _prompts(tmp_path / "p", bad)
        with pytest.raises(SystemExit) as stop:
            main(_worker(root, prompts, tmp_path / "out"))
        err = capsys.readouterr().err
        assert stop.value.code == 1 and err.count("\n") == 1, err
        assert err.startswith(f"error: {prompts}:2: ") and says in err, err


def test_chat_prompts_with_image_parts_render_one_image_token_per_image(tmp_path):
    """A chat prompt's image parts become the tokenizer's image text, one image token each (the
    compact form the trainer expands), in the order the messages show them."""
    from transformers import AutoTokenizer

    from treelit.cli.rollout_images import ImagePrompts
    from vision_oracle import vl_processor_dir

    ckpt = tmp_path / "ckpt"
    vl_processor_dir(ckpt)
    (ckpt / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "image_token_id": 151655,
                                                  "video_token_id": 151656, "vision_config": {}}))
    random_image(np.random.default_rng(0), 16, 24).save(tmp_path / "shot.png")
    rec = {"id": "c", "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                                {"type": "image", "image": "shot.png"}]}]}
    images, tok = ImagePrompts(ckpt), AutoTokenizer.from_pretrained(ckpt)
    images.prepare(rec, str(tmp_path / "prompts.jsonl"), "prompts.jsonl:1", tok)
    ids = rec["input_ids"]
    assert ids.count(151655) == 1 and ids[ids.index(151655) - 1] == 151652 and ids[ids.index(151655) + 1] == 151653
    assert rec["_vision"].ids.count(151655) == 6 and len(rec["_vision"].ids) == len(ids) + 5  # 16x24: 6 placeholders
    assert [im.size for im in rec["images"]] == [(24, 16)] and images.never == [151655, 151656]
    bad = {"id": "d", "messages": [{"role": "user", "content": [{"text": "no type"},
                                                                {"type": "image", "image": "shot.png"}]}]}
    with pytest.raises(ValueError, match=r"^prompts.jsonl:2: messages: the chat template cannot render them "):
        images.prepare(bad, str(tmp_path / "prompts.jsonl"), "prompts.jsonl:2", tok)


def test_square_colour_reads_the_colour_from_the_image(tmp_path):
    """The synthetic visual task: the reward is the image's, not a field's."""
    from PIL import Image

    from treelit.rl.visual_task import ANSWER_TOKENS, colour_of, square_image, write_prompts
    from treelit.rl.rewards import resolve_reward

    reward = resolve_reward("square_colour")
    rng = np.random.default_rng(0)
    for colour, token in ANSWER_TOKENS.items():
        im = square_image(rng, colour)
        assert colour_of(im) == colour
        assert reward([1], [token], images=[im]) == 1.0
        assert reward([1], [t for t in ANSWER_TOKENS.values() if t != token][:1], images=[im]) == 0.0
    path = write_prompts(tmp_path, 8, IMAGE, START, END)
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert recs[0]["input_ids"].count(IMAGE) == 1 and all("answer" not in r for r in recs)
    assert [colour_of(Image.open(tmp_path / r["images"][0])) for r in recs[:4]] == list(ANSWER_TOKENS)
    with pytest.raises(ValueError, match="square_colour needs the prompt's image"):
        reward([1], [10])


def test_what_image_prompts_do_not_run_with_is_one_line(policy, tmp_path, capsys):
    """--engine treelit on a vision checkpoint, routing replay with image prompts, an adapter on a
    vision base and --partial: each one error line (exit 1), before anything is sampled."""
    root, ckpt, _ = policy
    prompts = _prompts(tmp_path / "p")
    adapter = tmp_path / "lora" / "step-0"
    adapter.mkdir(parents=True)
    lora = {"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]}
    (adapter / "adapter_config.json").write_text(json.dumps(lora))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    (tmp_path / "lora" / "latest.json").write_text(json.dumps({"version": 0, "path": str(adapter),
                                                                "kind": "lora_adapter", "base": str(ckpt)}))
    cases = [(_worker(root, prompts, tmp_path / "o1", "--engine", "treelit"),
              "--engine treelit: a vision-language checkpoint (qwen2_5_vl) is sampled with transformers"),
             (_worker(root, prompts, tmp_path / "o2", "--record-routing"),
              "--record-routing (or a policy published with model.moe.routing=replay) with image prompts"),
             (["--publish-dir", str(tmp_path / "lora"), *_worker(root, prompts, tmp_path / "o3")[2:]],
              "an adapter on a vision-language base is not sampled yet"),
             (_worker(root, prompts, tmp_path / "o4", "--partial"),
              "a vision-language policy: --partial continues text generations only")]
    for argv, says in cases:
        with pytest.raises(SystemExit) as stop:
            main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 1 and err.count("\n") == 1 and err.startswith("error: ") and says in err, err
    assert not [p for o in ("o1", "o2", "o3", "o4") for p in (tmp_path / o).glob("step-*")]


def test_image_prompts_for_a_text_policy_are_one_line(tmp_path, capsys):
    from helpers import tiny_model

    PolicyPublisher(tmp_path / "policy", dtype="float32").publish(tiny_model("qwen2_tiny", torch.float32), 0)
    prompts = _prompts(tmp_path / "p")
    with pytest.raises(SystemExit) as stop:
        main(_worker(tmp_path, prompts, tmp_path / "out"))
    err = capsys.readouterr().err
    assert stop.value.code == 1
    assert err == f"error: {prompts}:1: a prompt with images needs a vision-language checkpoint\n", err
