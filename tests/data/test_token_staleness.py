"""Per-token provenance (``policy_versions``) and ``data.staleness_policy``: staleness counted per
token, stale tokens dropped from the loss (``drop_tokens``) with the tree loss and every gradient
equal to per-branch training of the same branches with those tokens' masks zeroed (a reference
written here from the definition, float64), whole branches dropped (``drop_branch``), the
metrics counted exactly, and bad versions refused in one line naming the record."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import TEST_VOCAB, assert_equivalent, tiny_model
from treelit.data.records import DataError
from treelit.lightning.rollouts import RolloutDirDataModule
from treelit.lightning.token_staleness import TokenStaleness
from treelit.models.context import CausalContext
from treelit.models.decoder import decoder_hidden, output_weight
from treelit.objectives import make_objective

PROMPT = 2
# branches of one group: shared prompt [1, 2], a shared sampled prefix [3, 4] whose versions
# disagree between the branches that carry it (branch 1 calls token 4 fresh), versions changing
# mid-branch (partial rollouts), a duplicate, and a branch that is a prefix of another
BRANCHES = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 8, 9], [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5], [1, 2, 10, 7, 9, 6]]
VERSIONS = [[None, None, 1, 1, 2, 3, 4], [None, None, 1, 3, 3, 4], [None, None, 1, 2, 2, 2, 4],
            [None, None, 0, 0, 4], [None, None, 4, 4, 3, 2]]
ADV = [1.0, -0.5, 0.25, 2.0, -1.5]


def write(d, name, recs):
    d.mkdir(exist_ok=True)
    (d / name).write_text("".join(json.dumps(r) + "\n" for r in recs))


def module(d, version, **kw):
    dm = RolloutDirDataModule(str(d), timeout_s=2, poll_s=0.01, **kw)
    dm.policy_version = lambda: version
    dm.setup()
    return dm


def branch_logprobs(model, ids):
    h = decoder_hidden(model, torch.tensor([ids]), torch.arange(len(ids))[None], CausalContext())[0]
    return torch.log_softmax(h @ output_weight(model).t(), -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def stale_masks(versions, trainer, max_staleness):
    """From the definition: a token trains when it is past the prompt and either unversioned or at
    most ``max_staleness`` versions behind the trainer."""
    return [[0 if t < PROMPT or (v is not None and trainer - v > max_staleness) else 1 for t, v in enumerate(vs)]
            for vs in versions]


def reference_loss(model, branches, masks, adv, old, objective):
    """Per-branch PPO (token-mean), each branch alone."""
    lo, hi = objective.clip_low, objective.clip_high
    n = sum(sum(m[1:]) for m in masks)
    total = torch.zeros((), dtype=torch.float64)
    for b, ids in enumerate(branches):
        lp = branch_logprobs(model, ids)
        for t in range(1, len(ids)):
            if masks[b][t]:
                ratio = torch.exp(lp[t - 1] - old[b][t])
                total = total - torch.minimum(ratio * adv[b], ratio.clamp(1 - lo, 1 + hi) * adv[b])
    return total / n


def _records(model, branches, versions, adv):
    with torch.no_grad():
        old = [[None] + branch_logprobs(model, ids).tolist() for ids in branches]
    recs = [{"id": f"r{b}", "branches": [{"input_ids": ids, "loss_mask": [0] * PROMPT + [1] * (len(ids) - PROMPT),
                                          "advantage": adv[b], "old_logprobs": old[b],
                                          "policy_versions": versions[b]}]} for b, ids in enumerate(branches)]
    return recs, old


def check(tmp_path, branches=BRANCHES, versions=VERSIONS, adv=ADV, trainer=4, max_staleness=1, seed=0):
    model = tiny_model("qwen2_5_tiny", seed=seed)
    objective = make_objective("ppo")
    recs, old = _records(model, branches, versions, adv)
    d = tmp_path / "r"
    write(d, "s0.jsonl", recs)
    dm = module(d, trainer, max_staleness=max_staleness, staleness_policy="drop_tokens")
    dm.check_against(TEST_VOCAB, 64, objective=objective)
    step = dm.load_step(0)
    (batch,) = step.micro_batches
    masks = stale_masks(versions, trainer, max_staleness)
    stale = [(b, t) for b, vs in enumerate(versions) for t, v in enumerate(vs)
             if t >= PROMPT and v is not None and trainer - v > max_staleness]
    assert stale and any(sum(m) for m in masks)
    # the metrics, counted from the definition
    m = dm.step_metrics
    hist = [0] * 5
    for vs in versions:
        for t, v in enumerate(vs):
            if t >= PROMPT and v is not None:
                hist[min(trainer - v, 4)] += 1
    assert [m[f"staleness/tokens_{k}"] for k in ("0", "1", "2", "3", "4plus")] == hist
    assert m["staleness/tokens_dropped"] == len(stale) and m["staleness/branches_dropped"] == 0
    with torch.no_grad():
        for p in model.parameters():  # ratios leave 1
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + 7), dtype=p.dtype))
    Z = batch.norm_contribution("token-mean")
    assert Z == sum(sum(mk[1:]) for mk in masks)

    def tree():
        return objective.tree_loss(model, batch, aggregation="token-mean", normalizer=Z)[0]

    def reference():
        return reference_loss(model, branches, masks, adv, old, objective)

    assert_equivalent(model, tree, reference, torch.float64, "drop_tokens")


def test_drop_tokens_tree_equals_per_branch_training_with_stale_masks_zeroed(tmp_path):
    """Default suite: versions changing mid-branch and disagreeing on a shared token."""
    check(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("max_staleness", [1, 2])
def test_drop_tokens_random_partial_rollouts(tmp_path, seed, max_staleness):
    rng = np.random.default_rng(seed)
    branches, versions = [], []
    for _ in range(6):
        base = list(branches[rng.integers(len(branches))]) if branches and rng.random() < 0.7 else [1, 2]
        cut = int(rng.integers(PROMPT, len(base) + 1))
        ids = base[:cut] + rng.integers(1, TEST_VOCAB, int(rng.integers(1, 5))).tolist()
        v0 = int(rng.integers(0, 5))
        vs = [None] * PROMPT + sorted(int(x) for x in rng.integers(v0, 6, len(ids) - PROMPT))  # versions grow
        branches.append(ids)
        versions.append(vs)
    check(tmp_path, branches, versions, rng.normal(size=6).tolist(), trainer=5, max_staleness=max_staleness,
          seed=seed)


def test_drop_branch_and_skip_file_count_exactly(tmp_path):
    recs = [{"id": "a", "branches": [{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1],
                                      "policy_versions": [None, 3, 3, 3], "advantage": 1.0},
                                     {"input_ids": [1, 2, 5, 6], "loss_mask": [0, 1, 1, 1],
                                      "policy_versions": [None, 3, 1, 3], "advantage": -1.0}]},
            {"id": "b", "branches": [{"input_ids": [7, 8, 9], "policy_versions": [None, 0, 0], "advantage": 1.0}]}]
    d = tmp_path / "r"
    write(d, "s0.jsonl", recs)
    dm = module(d, 3, max_staleness=1, staleness_policy="drop_branch")
    step = dm.load_step(0)
    assert sum(b.num_tokens for b in step.micro_batches) == 4  # only branch a[0]: [1, 2, 3, 4]
    m = dm.step_metrics
    assert (m["staleness/tokens_0"], m["staleness/tokens_2"], m["staleness/tokens_3"]) == (5, 1, 2)
    assert m["staleness/branches_dropped"] == 2 and m["staleness/tokens_dropped"] == 3 + 2
    # skip_file (the default): the file's staleness is its oldest token's
    d2 = tmp_path / "r2"
    write(d2, "s0.jsonl", recs)
    write(d2, "s1.jsonl", recs[:1])
    dm = module(d2, 3, max_staleness=2)
    dm.load_step(0)
    assert dm.step_files[0] == "s1.jsonl" and dm.step_metrics["rollout/files_skipped_stale"] == 1
    assert dm.step_metrics["rollout/staleness_max"] == 2


@pytest.mark.parametrize("versions,match", [
    ([None, 1, 5], r"s0.jsonl:1: branches\[0\].policy_versions\[2\]: version 5 is newer than the trainer's policy "
                   r"version 3 \(a version in the future"),
    ([None, 1], r"s0.jsonl:1: branches\[0\].policy_versions: must be a list of 3 versions \(one per token, null for "
                r"tokens not sampled\), got 2 entries"),
    ([None, -1, 2], r"s0.jsonl:1: branches\[0\].policy_versions\[1\]: must be a non-negative integer or null"),
])
def test_bad_versions_are_one_line_naming_the_record(tmp_path, versions, match):
    d = tmp_path / "r"
    write(d, "s0.jsonl", [{"id": "a", "branches": [{"input_ids": [1, 2, 3], "policy_versions": versions}]}])
    with pytest.raises(DataError, match=match) as e:
        module(d, 3, max_staleness=1, staleness_policy="drop_tokens").load_step(0)
    assert "\n" not in str(e.value)


def test_bad_policy_names_the_option():
    with pytest.raises(ValueError, match="data.staleness_policy must be one of skip_file, drop_tokens, drop_branch, "
                                         "got 'drop'"):
        TokenStaleness(1, "drop", 0)
    with pytest.raises(ValueError, match="data.staleness_policy"):
        RolloutDirDataModule("/tmp/x", staleness_policy="tokens")


def test_treelit_train_trains_with_drop_tokens_against_the_published_version(tmp_path):
    """Publishing every step: step 2 reads its file at version 1, where tokens sampled under
    version 0 are stale (max_staleness=0) and leave the loss; the rest trains, no file is skipped."""
    from app_helpers import SMALL
    from treelit.cli.config import compose
    from treelit.cli.train import run

    rng = np.random.default_rng(0)
    d = tmp_path / "r"
    for name, vs in (("s0", [0, 0, 0]), ("s1", [0, 1, 1])):
        branches = []
        for _ in range(3):
            ids = [1, 2, 3] + rng.integers(1, 11, 3).tolist()
            branches.append({"input_ids": ids, "loss_mask": [0, 0, 0, 1, 1, 1], "advantage": float(rng.normal()),
                             "policy_versions": [None] * 3 + vs})
        write(d, f"{name}.jsonl", [{"id": name, "branches": branches}])
    cfg = compose([f"output_dir={tmp_path / 'out'}", *SMALL, "data=rollouts", f"data.directory={d}", "data.timeout_s=5",
                   "data.max_staleness=0", "data.staleness_policy=drop_tokens", "objective=grpo",
                   "trainer.max_steps=2", f"publish.dir={tmp_path / 'policy'}", "publish.dtype=float32"])
    summary = run(cfg)
    assert summary["global_step"] == 2
    assert sorted(p.name for p in d.iterdir()) == ["s0.jsonl.consumed", "s1.jsonl.consumed"]
    m = summary["metrics"]
    assert (m["staleness/tokens_0"], m["staleness/tokens_1"], m["staleness/tokens_dropped"]) == (6, 3, 3)
    assert torch.isfinite(torch.tensor(m["loss"]))


# chat records: a version per assistant turn -----------------------------------------------------
@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    from treelit.data.tokenizers import build_qwen_tokenizer

    return str(build_qwen_tokenizer(tmp_path_factory.mktemp("tok") / "qwen"))


def conversation(v1, v2, tool_version=None):
    tool = {"role": "tool", "tool_call_id": "c1", "name": "lookup", "content": "order 7: shipped"}
    if tool_version is not None:
        tool["policy_version"] = tool_version
    return [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Find order 7."},
            {"role": "assistant", "content": "Looking.", "policy_version": v1,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
            tool, {"role": "assistant", "content": "It shipped.", "policy_version": v2}]


@pytest.mark.parametrize("export", ["trajectory", "per_call"])
def test_chat_turn_versions_drop_exactly_the_stale_turns_tokens(qwen_dir, export):
    from treelit.builders.chat import ChatBuilder
    from treelit.data.records import Record

    b = ChatBuilder(qwen_dir, export=export)
    rec = Record({"id": "a", "messages": conversation(1, 3)}, "c.jsonl:1")
    plain = Record({"id": "a", "messages": conversation(None, None)}, "c.jsonl:1")
    encoded = b.encode(rec)
    assert [br["loss_mask"] for br in encoded] == [br["loss_mask"] for br in b.encode(plain)]  # versions change no mask
    first = [t for t, m in enumerate(b.encode(Record({"id": "a", "messages": conversation(None, None)[:3]},
                                                      "c.jsonl:1"))[0]["loss_mask"]) if m]
    hook = TokenStaleness(1, "drop_tokens", 3)
    out = hook(rec, encoded)
    kept = [(br["input_ids"], br["loss_mask"]) for br in out]
    text = "".join(b.tok.decode([t for t, m in zip(ids, mask) if m]) for ids, mask in kept)
    assert text == "It shipped.<|im_end|>\n"  # the first turn (2 behind) left the loss, the second trains
    n_second = len(b.tok("It shipped.<|im_end|>\n", add_special_tokens=False)["input_ids"])
    m = hook.metrics()
    assert (m["staleness/tokens_2"], m["staleness/tokens_0"], m["staleness/tokens_dropped"]) == (len(first), n_second,
                                                                                                  len(first))
    # drop_branch: the per-call branch of the stale turn goes; the trajectory (one branch) goes whole
    out = TokenStaleness(1, "drop_branch", 3)(rec, b.encode(rec))
    assert out is None if export == "trajectory" else [br["_where"] for br in out] == ["messages[4]"]


def test_chat_turn_versions_bad_values_and_file_staleness(qwen_dir, tmp_path):
    from treelit.builders.chat import ChatBuilder

    d = tmp_path / "r"
    write(d, "s0.jsonl", [{"id": "a", "messages": conversation(0, 3)}])  # oldest turn 3 behind: skipped
    write(d, "s1.jsonl", [{"id": "b", "messages": conversation(2, 3)}])
    dm = module(d, 3, max_staleness=1, tree_builder=ChatBuilder(qwen_dir, export="per_call"))
    dm.load_step(0)
    assert dm.step_files[0] == "s1.jsonl" and dm.step_metrics["rollout/staleness_max"] == 1
    for name, conv, match in (
            ("f.jsonl", conversation(1, 4), r"f.jsonl:1: messages\[4\].policy_version: version 4 is newer than the "
                                            r"trainer's policy version 3 \(a version in the future"),
            ("g.jsonl", conversation(1, 2, tool_version=1), r"g.jsonl:1: messages\[3\].policy_version: only "
                                                            r"assistant messages are sampled"),
            ("h.jsonl", conversation(1, "v2"), r"h.jsonl:1: messages\[4\].policy_version: must be a non-negative "
                                               r"integer, got 'v2'")):
        d = tmp_path / name
        write(d, name, [{"id": "a", "messages": conv}])
        with pytest.raises(DataError, match=match) as e:
            module(d, 3, max_staleness=1, staleness_policy="drop_tokens",
                   tree_builder=ChatBuilder(qwen_dir, export="per_call")).load_step(0)
        assert "\n" not in str(e.value)
