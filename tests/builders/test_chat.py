"""The chat builder on hand-made conversations and on the real tau-bench trajectories,
tokenized with the real Qwen2 BPE (built offline)."""

from __future__ import annotations

import pytest

from treelit.builders.chat import ChatBuilder
from treelit.cli.config import bundled_path
from treelit.data.records import DataError, Record, read_records

TAU = "tau_bench_airline/gpt-4o-airline.json.gz"


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory):
    from treelit.data.tokenizers import build_qwen_tokenizer

    return str(build_qwen_tokenizer(tmp_path_factory.mktemp("tok") / "qwen"))


def masked_text(tok, ids, mask):
    return tok.decode([t for t, m in zip(ids, mask) if m])


CALL = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"id": 7}'}}
CONV = [
    {"role": "system", "content": "You are an agent."},
    {"role": "user", "content": "Find order 7."},
    {"role": "assistant", "content": "Looking.", "reasoning_content": "Need the lookup tool.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "name": "lookup", "content": "order 7: shipped"},
    {"role": "assistant", "content": "It shipped."},
]


def test_qwen_ids_match_qwen(qwen_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_dir)
    assert tok("<|im_start|>user\n", add_special_tokens=False)["input_ids"] == [151644, 872, 198]


def test_per_call_branches_train_only_the_call_output(qwen_dir):
    b = ChatBuilder(qwen_dir, export="per_call")
    (first, second) = b.branches_of(CONV, "x")
    tok = b.tok
    # call 1 sees its own thinking; its targets are exactly its output and the end of its turn
    assert masked_text(tok, *first) == (
        '<think>\nNeed the lookup tool.\n</think>\n\nLooking.\n<tool_call>\n{"name": "lookup", "arguments": {"id": 7}}'
        "\n</tool_call><|im_end|>\n"
    )
    assert masked_text(tok, *second) == "It shipped.<|im_end|>\n"
    # call 2's context has dropped the thinking of call 1
    assert "Need the lookup tool" not in tok.decode(second[0])
    assert tok.decode(first[0]).startswith("<|im_start|>system\nYou are an agent.<|im_end|>")


def test_trajectory_export_trains_every_assistant_message(qwen_dir):
    b = ChatBuilder(qwen_dir, export="trajectory")
    ((ids, mask),) = b.branches_of(CONV, "x")
    text = masked_text(b.tok, ids, mask)
    assert "Looking." in text and "It shipped." in text and "order 7: shipped" not in text
    assert "<|im_start|>assistant" not in text  # role headers are context


def test_compaction_replaces_history(qwen_dir):
    conv = CONV + [
        {"role": "user", "content": "Summary: order 7 shipped.", "compaction": True},
        {"role": "assistant", "content": "Anything else?"},
    ]
    b = ChatBuilder(qwen_dir, export="per_call")
    last = b.branches_of(conv, "x")[-1]
    text = b.tok.decode(last[0])
    assert "You are an agent." in text and "Summary: order 7 shipped." in text
    assert "Find order 7." not in text and "It shipped." not in text


def test_concurrent_calls_as_explicit_branches_merge_into_one_tree(qwen_dir):
    b = ChatBuilder(qwen_dir, export="trajectory")
    rec = {"id": "r", "branches": [{"messages": CONV[:2] + [{"role": "assistant", "content": f"option {i}"}]} for i in range(3)]}
    (built,) = b([Record(rec, "mem:1")])
    s = built.tree.stats()
    assert s["branches"] == 3 and s["leaves"] == 3 and s["por"] > 0.5


def test_bad_chat_record_names_the_field(qwen_dir):
    b = ChatBuilder(qwen_dir)
    with pytest.raises(DataError, match=r"mem:3: messages\[1\].role: must be one of"):
        b.validate({"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}, "mem:3")
    with pytest.raises(ValueError, match="tokenizer directory '/nope' does not exist"):
        ChatBuilder("/nope")


def _tau_subset(n_tasks):
    recs = read_records(bundled_path(TAU), validate=None)
    return [r for r in recs if r.data["task_id"] < n_tasks]


@pytest.mark.parametrize("export", ["per_call", "trajectory"])
def test_tau_bench_subset_one_tree_per_task(qwen_dir, export):
    recs = _tau_subset(3)
    assert len(recs) == 12  # 3 tasks x 4 trials
    trees = ChatBuilder(qwen_dir, export=export, group_key="task_id")(recs)
    assert len(trees) == 3
    flat = sum(t.tree.stats()["flat_tokens"] for t in trees)
    tree = sum(t.tree.stats()["tree_tokens"] for t in trees)
    por = 1 - tree / flat
    if export == "per_call":
        assert por > 0.85  # each call's context is the previous call's plus a turn
    else:
        assert 0.1 < por < 0.5  # only the system prompt and first turn are shared


@pytest.mark.slow
def test_tau_bench_full_statistics_match_the_dataset_notes(qwen_dir):
    """Figures from the dataset notes: per-call 7.6M flat -> 0.61M tree (POR 0.92, ideal 12.5x);
    whole trajectories grouped by task 0.80M -> 0.61M (ideal 1.3x)."""
    recs = list(read_records(bundled_path(TAU), validate=None))
    for export, flat_m, por, ideal in [("per_call", 7.6, 0.92, 12.5), ("trajectory", 0.80, 0.24, 1.31)]:
        trees = ChatBuilder(qwen_dir, export=export, group_key="task_id")(recs)
        assert len(trees) == 50
        flat = sum(t.tree.stats()["flat_tokens"] for t in trees)
        tree = sum(t.tree.stats()["tree_tokens"] for t in trees)
        assert flat / 1e6 == pytest.approx(flat_m, rel=0.02)
        assert tree / 1e6 == pytest.approx(0.61, rel=0.02)
        assert 1 - tree / flat == pytest.approx(por, abs=0.01)
        assert flat / tree == pytest.approx(ideal, rel=0.02)
