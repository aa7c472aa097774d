"""One regression test per way bad input used to be mis-built or badly reported, each with its
minimal record: the outcome is a correct build, or an error naming file, line and field
before training (``on_error=skip``: the record is skipped, counted and logged)."""

from __future__ import annotations

import gzip
import json
import logging

import numpy as np
import pytest

from pipeline import branches_of, run, write
from treelit.data.records import DataError

U = {"role": "user", "content": "hi"}
A = {"role": "assistant", "content": "hello"}


@pytest.fixture(scope="module")
def tok():
    from treelit.builders.chat import load_tokenizer
    from treelit.data.tokenizers import qwen_tokenizer_dir

    return load_tokenizer(qwen_tokenizer_dir())


def chat(tmp_path, tok, recs, on_error="raise", **opts):
    objective = "grpo" if opts.get("advantage") else "sft"
    return run(write(tmp_path / "c.jsonl", recs), builder="chat", tokenizer=tok, vocab=200_000, max_len=4096,
               on_error=on_error, objective=objective, builder_options=opts)


FORMATS = ["jsonl", "json", "parquet"]


def path(tmp_path, fmt):
    return tmp_path / f"d.{fmt}"


# 1. group keys keep their JSON type ------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
def test_1_int_and_string_keys_are_different_groups(tmp_path, fmt):
    recs = [{"branches": [{"input_ids": [1, 2], "group": 7}]}, {"branches": [{"input_ids": [1, 3], "group": "7"}]}]
    dm = run(write(path(tmp_path, fmt), recs), builder="groups")
    assert sorted(t.id for t in dm.trees) == ["group='7'", "group=7"]


@pytest.mark.parametrize("key", [True, [1], 1.5, {"a": 1}])
def test_1_keys_that_are_not_strings_or_integers_are_refused(tmp_path, key):
    recs = [{"branches": [{"input_ids": [1, 2], "group": key}]}, {"branches": [{"input_ids": [1, 3], "group": str(key)}]}]
    with pytest.raises(DataError, match=r"d.jsonl:1: branches\[0\].group: must be a string or an integer"):
        run(write(tmp_path / "d.jsonl", recs), builder="groups")


# 2. a branch without a key stays, in its record's tree -----------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_2_branch_without_group_key_is_kept(tmp_path, fmt):
    recs = [{"id": "a", "branches": [{"input_ids": [1, 2], "group": "g"}, {"input_ids": [1, 3]}]}]
    dm = run(write(path(tmp_path, fmt), recs), builder="groups")
    assert sorted(branches_of(dm)) == [[1, 2], [1, 3]]


# 3. chat: thinking must be text, compaction must be a boolean ----------------------------------


@pytest.mark.parametrize("value", [{"a": 1}, 3, ["x"]])
def test_3_non_string_reasoning_is_refused(tmp_path, tok, value):
    with pytest.raises(DataError, match=r"c.jsonl:1: messages\[1\].reasoning_content: must be a string or null"):
        chat(tmp_path, tok, [{"messages": [U, dict(A, reasoning_content=value)]}])


@pytest.mark.parametrize("value", ["false", [0], {}, 1])
def test_3_non_boolean_compaction_is_refused(tmp_path, tok, value):
    with pytest.raises(DataError, match=r"c.jsonl:1: messages\[2\].compaction: must be true or false"):
        chat(tmp_path, tok, [{"messages": [U, A, dict(U, compaction=value), A]}])


# 4. duplicate ids where they would have merged records -----------------------------------------


def test_4_duplicate_ids_of_ungrouped_chat_records_name_both_lines(tmp_path, tok):
    with pytest.raises(DataError, match=r"c.jsonl:2: id: duplicate id 'x' \(also at .*c.jsonl:1\)"):
        chat(tmp_path, tok, [{"id": "x", "messages": [U, A]}, {"id": "x", "messages": [U, dict(A, content="yo")]}],
             group_key=None)


def test_4_duplicate_ids_as_default_advantage_groups_name_both_lines(tmp_path):
    recs = [{"id": "a", "branches": [{"input_ids": [1, 2], "reward": 1}, {"input_ids": [1, 4], "reward": 0}]},
            {"id": "a", "branches": [{"input_ids": [1, 3], "reward": 0}, {"input_ids": [1, 5], "reward": 1}]}]
    with pytest.raises(DataError, match=r"d.jsonl:2: id: duplicate id 'a' \(also at .*d.jsonl:1\)"):
        run(write(tmp_path / "d.jsonl", recs), builder_options={"advantage": "grpo"}, objective="grpo")
    # where ids play no part (no estimator), duplicates are two records as written
    dm = run(write(tmp_path / "d.jsonl", recs))
    assert len(dm.trees) == 2


# 5. trajectory export: a conversation with nothing to train on -----------------------------------


def test_5_conversation_without_assistant_is_refused_and_skipped_before_the_baseline(tmp_path, tok, caplog):
    recs = [{"messages": [U, A], "reward": 1, "group": "g"}, {"messages": [U, U], "reward": 0, "group": "g"},
            {"messages": [U, dict(A, content="yo")], "reward": 0, "group": "g"}]
    with pytest.raises(DataError, match=r"c.jsonl:2: messages: no assistant message to train on"):
        chat(tmp_path, tok, recs, advantage="grpo", export="trajectory")
    with caplog.at_level(logging.WARNING):
        dm = chat(tmp_path, tok, recs, on_error="skip", advantage="grpo", export="trajectory")
    assert dm.read_stats.skipped == 1 and "c.jsonl:2: messages: no assistant" in caplog.text
    # the baseline holds the two kept conversations only: rewards 1 and 0
    a = 0.5 / (np.sqrt(0.5) + 1e-6)
    np.testing.assert_allclose(dm.trees[0].tree.branch_adv, [a, -a], rtol=1e-9)


# 6. unreadable bytes, truncated streams, deep nesting, huge numbers ------------------------------

GOOD = json.dumps({"branches": [{"input_ids": [1, 2, 3]}]}).encode()


@pytest.mark.parametrize("bad", [b'{"id": "\xff\xfe"}', '{"id": "caf\u00e9"}'.encode("latin-1")])
def test_6_invalid_utf8_names_the_line_and_skip_goes_on(tmp_path, bad):
    p = tmp_path / "d.jsonl"
    p.write_bytes(GOOD + b"\n" + bad + b"\n" + GOOD + b"\n")
    with pytest.raises(DataError, match=r"d.jsonl:2: not valid UTF-8"):
        run(p)
    dm = run(p, on_error="skip")
    assert dm.read_stats.skipped == 1 and len(dm.trees) == 2


def test_6_utf16_file_names_the_file(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes((GOOD.decode() + "\n").encode("utf-16"))
    with pytest.raises(DataError, match=r"d.jsonl:1: not valid UTF-8"):
        run(p)


def test_6_truncated_gzip(tmp_path):
    p = tmp_path / "d.jsonl.gz"
    data = gzip.compress((GOOD + b"\n") * 4000)
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"d.jsonl.gz:\d+: truncated or corrupt gzip data after line \d+"):
        run(p)
    dm = run(p, on_error="skip")
    assert dm.read_stats.skipped == 1 and len(dm.trees) > 50


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
def test_6_deep_nesting(tmp_path, fmt):
    p = tmp_path / f"d.{fmt}"
    p.write_bytes(b"[" * 100000 + b"]" * 100000 + b"\n")
    with pytest.raises(DataError, match=rf"d.{fmt}:1: invalid JSON \(nested too deeply"):
        run(p)


@pytest.mark.parametrize("field", ["weight", "reward", "advantage"])
def test_6_huge_integers_are_not_finite_numbers(tmp_path, field):
    p = tmp_path / "d.jsonl"
    p.write_text('{"branches": [{"input_ids": [1, 2], "%s": 1%s}]}\n' % (field, "0" * 400))
    with pytest.raises(DataError, match=rf"d.jsonl:1: branches\[0\].{field}: must be a finite number"):
        run(p)


def test_6_token_ids_beyond_int64(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"branches": [{"input_ids": [1, 9223372036854775808]}]}\n')
    with pytest.raises(DataError, match=r"d.jsonl:1: branches\[0\].input_ids\[1\]: token id 9223372036854775808 is out of range"):
        run(p)


# 7. fields present on some records only --------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("field,value", [("group", "g"), ("reward", 1.0), ("old_logprobs", [None, -1.0]),
                                         ("ref_logprobs", [None, -1.0]), ("advantage", 0.5)])
def test_7_a_field_on_some_records_only_packs(tmp_path, fmt, field, value):
    recs = [{"branches": [{"input_ids": [1, 2], field: value}]}, {"branches": [{"input_ids": [1, 3]}]}]
    dm = run(write(path(tmp_path, fmt), recs))  # sft: everything packs into one step
    assert len(dm.trees) == 2
    if field == "advantage":
        with pytest.raises(DataError, match=r"d\.\w+:(2|row 1|record 1): branches\[0\].advantage: objective=ppo needs"):
            run(write(path(tmp_path, fmt), recs), objective="ppo")
    else:
        recs = [{"branches": [dict(b, advantage=1.0) for b in r["branches"]]} for r in recs]
        run(write(path(tmp_path, fmt), recs), objective="ppo")  # packs with rollout log-probs on some only


def test_7_training_stops_before_fit(tmp_path):
    """Through treelit-train: a missing advantage is reported before the trainer starts."""
    from app_helpers import SMALL
    from treelit.cli.config import compose
    from treelit.cli.train import run as train

    p = write(tmp_path / "d.jsonl", [{"branches": [{"input_ids": [1, 2], "advantage": 1.0}]},
                                     {"branches": [{"input_ids": [1, 3]}]}])
    cfg = compose([f"output_dir={tmp_path / 'out'}", *SMALL, "data=jsonl", f"data.train_path={p}", "objective=ppo",
                   "trainer.max_steps=1", "model.config.vocab_size=16"])
    with pytest.raises(DataError, match=r"d.jsonl:2: branches\[0\].advantage"):
        train(cfg)
    assert not (tmp_path / "out" / "checkpoints").exists()


# 8. errors in merged group trees name the offending line ------------------------------------------


def test_8_bad_token_in_a_group_names_its_own_line(tmp_path):
    recs = [{"branches": [{"input_ids": [1, 2], "group": "g"}]}, {"branches": [{"input_ids": [1, 2, 700], "group": "g"}]}]
    with pytest.raises(DataError, match=r"d.jsonl:2: branches\[0\].input_ids\[2\]: token id 700"):
        run(write(tmp_path / "d.jsonl", recs), builder="groups")


def test_8_too_long_branch_in_a_group_names_its_own_line(tmp_path):
    recs = [{"branches": [{"input_ids": [1, 2], "group": "g"}]}, {"branches": [{"input_ids": [1] * 200, "group": "g"}]}]
    with pytest.raises(DataError, match=r"d.jsonl:2: branches\[0\]: 200 tokens, more than the model's max_seq_len"):
        run(write(tmp_path / "d.jsonl", recs), builder="groups")


def test_8_logprob_conflict_names_both_lines(tmp_path):
    recs = [{"branches": [{"input_ids": [1, 2, 3], "group": "g", "advantage": 1, "old_logprobs": [None, -1, -2]}]},
            {"branches": [{"input_ids": [1, 2, 3, 4], "group": "g", "advantage": 1, "old_logprobs": [None, -1, -2.5, -1]}]}]
    with pytest.raises(DataError, match=r"d.jsonl:2: branches\[0\].old_logprobs\[2\] = -2.5 disagrees with .*d.jsonl:1 "
                                        r"branches\[0\]"):
        run(write(tmp_path / "d.jsonl", recs), builder="groups", objective="ppo")


def test_8_missing_advantage_in_a_group_names_its_own_line(tmp_path):
    recs = [{"branches": [{"input_ids": [1, 2], "group": "g", "advantage": 1.0}]},
            {"branches": [{"input_ids": [1, 3], "group": "g"}]}]
    with pytest.raises(DataError, match=r"d.jsonl:2: branches\[0\].advantage"):
        run(write(tmp_path / "d.jsonl", recs), builder="groups", objective="ppo")
    with pytest.raises(DataError, match=r"d.jsonl:2: branches\[0\].advantage: missing while \S*d.jsonl:1 branches\[0\]"):
        from treelit.builders.groups import GroupsBuilder
        from treelit.data.records import read_records

        GroupsBuilder()(read_records(tmp_path / "d.jsonl"))  # no objective: still pinned to its line


# 9. rewards and keys under an advantage estimator ---------------------------------------------------


def test_9_branch_without_reward_names_line_and_field(tmp_path):
    recs = [{"branches": [{"input_ids": [1, 2], "reward": 1}, {"input_ids": [1, 3]}]}]
    with pytest.raises(DataError, match=r"d.jsonl:1: branches\[1\].reward: tree_builder.advantage=grpo needs a finite"):
        run(write(tmp_path / "d.jsonl", recs), builder_options={"advantage": "grpo"}, objective="grpo")


def test_9_nan_chat_reward_and_list_key(tmp_path, tok):
    with pytest.raises(DataError, match=r"c.jsonl:1: reward: must be a finite number, got nan"):
        chat(tmp_path, tok, [{"messages": [U, A], "reward": float("nan"), "group": "g"}], advantage="grpo")
    with pytest.raises(DataError, match=r"c.jsonl:1: group: must be a string or an integer, got list"):
        chat(tmp_path, tok, [{"messages": [U, A], "reward": 1, "group": ["g"]}], advantage="grpo")


# 10. malformed tool calls and lone surrogates -------------------------------------------------------


@pytest.mark.parametrize("call,field", [
    ({"function": {"arguments": "{}"}}, r"tool_calls\[0\].function.name"),
    ({"function": {"name": 3, "arguments": "{}"}}, r"tool_calls\[0\].function.name"),
    ({"function": "lookup"}, r"tool_calls\[0\].function: must be an object"),
    (None, r"tool_calls\[0\]: a tool call must be an object"),
])
def test_10_malformed_tool_calls(tmp_path, tok, call, field):
    with pytest.raises(DataError, match=rf"c.jsonl:1: messages\[1\].{field}"):
        chat(tmp_path, tok, [{"messages": [U, dict(A, tool_calls=[call])]}])


def test_10_lone_surrogate(tmp_path, tok):
    p = tmp_path / "c.jsonl"
    p.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a\\ud800b"}]}\n')
    with pytest.raises(DataError, match=r"c.jsonl:1: messages\[1\].content: contains a lone surrogate"):
        run(p, builder="chat", tokenizer=tok, vocab=200_000, max_len=4096)


# 11 (and the reliability item): skip covers builder and model checks -------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_11_skip_covers_model_and_builder_checks(tmp_path, fmt, caplog):
    recs = [{"branches": [{"input_ids": [1, 2, 3]}]},
            {"branches": [{"input_ids": [1, 2, 900]}]},  # outside the vocabulary (600)
            {"branches": [{"input_ids": [1] * 200}]},  # longer than max_seq_len (96)
            {"branches": [{"input_ids": [1, 5]}]}]
    p = write(path(tmp_path, fmt), recs)
    with pytest.raises(DataError, match="outside the model's vocabulary"):
        run(p)
    with caplog.at_level(logging.WARNING):
        dm = run(p, on_error="skip")
    assert dm.read_stats.skipped == 2 and sorted(branches_of(dm)) == [[1, 2, 3], [1, 5]]
    assert "skipping bad record" in caplog.text and "vocabulary" in caplog.text and "max_seq_len" in caplog.text
    assert "skipped 2 malformed records" in caplog.text


def test_11_skip_a_group_whose_records_disagree(tmp_path):
    recs = [{"branches": [{"input_ids": [1, 2, 3], "group": "g", "advantage": 1, "old_logprobs": [None, -1, -2]}]},
            {"branches": [{"input_ids": [1, 2, 3, 4], "group": "g", "advantage": 1, "old_logprobs": [None, -1, -2.5, -1]}]},
            {"branches": [{"input_ids": [5, 6], "group": "h", "advantage": 1}]}]
    dm = run(write(tmp_path / "d.jsonl", recs), builder="groups", objective="ppo", on_error="skip")
    assert dm.read_stats.skipped == 2 and branches_of(dm) == [[5, 6]]


def test_skip_through_treelit_train_counts_model_check_failures(tmp_path):
    from app_helpers import SMALL
    from treelit.cli.config import compose
    from treelit.cli.train import run as train

    recs = [{"branches": [{"input_ids": [1, 2, 3, 4]}]}] * 9 + [{"branches": [{"input_ids": [1, 2, 40]}]}]
    p = write(tmp_path / "d.jsonl", recs)
    cfg = compose([f"output_dir={tmp_path / 'out'}", *SMALL, "data=jsonl", f"data.train_path={p}", "data.on_error=skip",
                   "trainer.max_steps=1", "model.config.vocab_size=16"])
    summary = train(cfg)
    assert summary["global_step"] == 1 and summary["data"]["records_skipped"] == 1 and summary["data"]["trees"] == 9


# advantages: groups of one ---------------------------------------------------------------------------


@pytest.mark.parametrize("group", [None, "missing"])
def test_singleton_groups_everywhere_are_refused_naming_the_key(tmp_path, group):
    br = lambda ids, r: {"input_ids": ids, "reward": r, **({} if group == "missing" else {"group": group})}  # noqa: E731
    recs = [{"branches": [br([1, 2], 1.0)]}, {"branches": [br([1, 3], 0.0)]}]
    with pytest.raises(DataError, match=r"d.jsonl: advantage estimator 'grpo': all 2 groups \(samples sharing 'group'\)"):
        run(write(tmp_path / "d.jsonl", recs), builder_options={"advantage": "grpo"}, objective="grpo")
    dm = run(write(tmp_path / "d.jsonl", recs), builder_options={"advantage": "reinforce_pp"}, objective="grpo")
    assert [float(t.tree.branch_adv[0]) for t in dm.trees] == pytest.approx([1.0, -1.0], rel=1e-5)


def test_some_singleton_groups_warn_once_with_their_count(tmp_path, caplog):
    recs = [{"branches": [{"input_ids": [1, 2], "reward": 1.0}, {"input_ids": [1, 3], "reward": 0.0}]},
            {"branches": [{"input_ids": [1, 4], "reward": 1.0}]}, {"branches": [{"input_ids": [1, 5], "reward": 0.0}]}]
    with caplog.at_level(logging.WARNING):
        run(write(tmp_path / "d.jsonl", recs), builder_options={"advantage": "rloo"}, objective="grpo")
    msgs = [r.getMessage() for r in caplog.records if "single sample" in r.getMessage()]
    assert len(msgs) == 1 and "2 of 3 groups" in msgs[0]


def test_chat_without_group_key_is_refused_under_a_group_estimator(tmp_path, tok):
    recs = [{"messages": [U, A], "reward": 1}, {"messages": [U, dict(A, content="yo")], "reward": 0}]
    with pytest.raises(DataError, match="tree_builder.group_key is not set"):
        chat(tmp_path, tok, recs, advantage="grpo", group_key=None)


def test_chat_advantages_count_each_conversation_once(tmp_path, tok):
    """per_call: a conversation of three calls and one of one call, rewards 1 and 0: both
    conversations weigh the same in the group's mean and std (advantages +-1/sqrt2)."""
    long = [U, A, U, dict(A, content="two"), U, dict(A, content="three")]
    recs = [{"messages": long, "reward": 1, "group": "g"}, {"messages": [U, dict(A, content="x")], "reward": 0, "group": "g"}]
    dm = chat(tmp_path, tok, recs, advantage="grpo")
    a = 0.5 / (np.sqrt(0.5) + 1e-6)
    assert sorted(dm.trees[0].tree.branch_adv.tolist()) == pytest.approx([-a, a, a, a], rel=1e-9)


def test_a_jsonl_line_cut_short_is_reported_at_its_end(tmp_path):
    """The column of a line cut short is where the line ends, not column 1."""
    import json as _json

    from treelit.data.records import DataError, read_records

    good = _json.dumps({"id": "a", "branches": [{"input_ids": list(range(100))}]})
    cut = good[:200]
    f = tmp_path / "mixed.jsonl"
    f.write_text(good + "\n" + cut + "\n")
    with pytest.raises(DataError, match=rf"mixed.jsonl:2: invalid JSON \(.* at column {len(cut) + 1}\)"):
        list(read_records(str(f)))
