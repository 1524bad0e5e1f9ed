import json
import shutil

import pytest

from mm_core.errors import ConfigError, DataError
from mm_data_text.packing import IGNORE_INDEX
from mm_data_text.sft import SFTDataset

CONVERSATIONS = [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Add two numbers."},
        {"role": "assistant", "content": "def add(a, b):\n    return a + b\n"},
    ],
    [
        {"role": "user", "content": "What does the fox do?"},
        {"role": "assistant", "content": " The quick brown fox jumps over the lazy dog."},
    ],
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def make(tmp_path, tokenizer_dir, rows, **basic):
    write_jsonl(tmp_path / "chat.jsonl", rows)
    basic = {"dataset_dir": str(tmp_path), "dataset": "chat.jsonl", **basic}
    return SFTDataset(basic, {"model_name_or_path": str(tokenizer_dir)}, None, seed=0)


def labelled_runs(item):
    runs, current = [], []
    for token, label in zip(item["input_ids"].tolist(), item["labels"].tolist()):
        if label == IGNORE_INDEX:
            if current:
                runs.append(current)
            current = []
        else:
            assert label == token
            current.append(label)
    return runs + ([current] if current else [])


def check_masking(ds, tokenizer):
    assert len(ds) == len(CONVERSATIONS)
    for i, messages in enumerate(CONVERSATIONS):
        item = ds[i]
        assert item["sample_id"] == i
        assert item["position_ids"].tolist() == list(range(len(item["input_ids"])))
        assert tokenizer.decode(item["input_ids"]) == tokenizer.apply_chat_template(messages, tokenize=False)
        replies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        assert [tokenizer.decode(run) for run in labelled_runs(item)] == replies


def test_only_assistant_replies_and_end_token_are_labelled(tmp_path, tokenizer_dir, tokenizer):
    rows = [{"messages": m} for m in CONVERSATIONS]
    check_masking(make(tmp_path, tokenizer_dir, rows), tokenizer)


def test_template_without_generation_markers_gives_the_same_labels(tmp_path, tokenizer_dir, tokenizer):
    plain_dir = tmp_path / "plain_tok"
    shutil.copytree(tokenizer_dir, plain_dir)
    config_path = plain_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = (
        config["chat_template"].replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    )
    config_path.write_text(json.dumps(config))
    rows = [{"messages": m} for m in CONVERSATIONS]
    plain = make(tmp_path, plain_dir, rows)
    marked = make(tmp_path, tokenizer_dir, rows)
    check_masking(plain, tokenizer)
    for i in range(len(marked)):
        assert plain[i]["labels"].tolist() == marked[i]["labels"].tolist()


def test_cutoff_len_truncates_and_skips_samples_without_labels(tmp_path, tokenizer_dir, tokenizer):
    long_prompt = [{"role": "user", "content": "lazy dog " * 40}, {"role": "assistant", "content": "Hello!"}]
    rows = [{"messages": CONVERSATIONS[1]}, {"messages": long_prompt}]
    ds = make(tmp_path, tokenizer_dir, rows, cutoff_len=24)
    assert len(ds) == 1 and ds.num_skipped == 1 and ds.skipped[0].endswith("chat.jsonl:2")
    assert len(ds[0]["input_ids"]) == 24
    with pytest.raises(DataError, match="no sample keeps an assistant token"):
        make(tmp_path, tokenizer_dir, [{"messages": long_prompt}], cutoff_len=24)


def test_malformed_records(tmp_path, tokenizer_dir):
    ok = {"messages": CONVERSATIONS[1]}
    with pytest.raises(DataError, match=r'chat\.jsonl:2: missing key "messages"'):
        make(tmp_path, tokenizer_dir, [ok, {"conversation": []}])
    with pytest.raises(DataError, match=r"chat\.jsonl:1: messages\[0\]\.role is 'bot'"):
        make(tmp_path, tokenizer_dir, [{"messages": [{"role": "bot", "content": "x"}]}])
    with pytest.raises(DataError, match=r"chat\.jsonl:1: the conversation has no assistant message"):
        make(tmp_path, tokenizer_dir, [{"messages": [{"role": "user", "content": "x"}]}])
    (tmp_path / "chat2.jsonl").write_text(json.dumps(ok) + "\nnot json\n")
    with pytest.raises(DataError, match=r"chat2\.jsonl:2: invalid JSON"):
        SFTDataset(
            {"dataset": str(tmp_path / "chat2.jsonl")},
            {"model_name_or_path": str(tokenizer_dir)},
            None,
            seed=0,
        )


def test_config_errors(tmp_path, tokenizer_dir):
    rows = [{"messages": CONVERSATIONS[1]}]
    with pytest.raises(
        ConfigError, match=r"basic_parameters\.cutoff_length: unknown key; did you mean 'cutoff_len'"
    ):
        make(tmp_path, tokenizer_dir, rows, cutoff_length=8)
    no_template = tmp_path / "no_template_tok"
    shutil.copytree(tokenizer_dir, no_template)
    config = json.loads((no_template / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(
        ConfigError, match=r"model_name_or_path: the tokenizer at .* has no \(single\) chat_template"
    ):
        make(tmp_path, no_template, rows)
