"""A 5 MB record (one jsonl line of real text) prepares in well under two seconds: the conversation is cut
before it is tokenised (mm_data_text.chat), where encoding it whole took 9-14 s and ~0.8 GB."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from mm_data_text.packing import IGNORE_INDEX
from mm_data_text.sft import SFTDataset
from mm_data_text.tokenizer import load_tokenizer

QUICKSTART_TOKENIZER = Path(__file__).resolve().parents[3] / "examples" / "quickstart" / "tokenizer"
pytestmark = pytest.mark.skipif(
    not (QUICKSTART_TOKENIZER / "tokenizer.json").is_file(), reason="quickstart assets not present"
)


def five_megabytes(shape: str) -> list[dict[str, str]]:
    """The Python reference manual's topics, repeated to 5 MB: as ~1,700 turns, or as one reply."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    texts = [topics[names[i % len(names)]] for i in range(11 * len(names))]  # 11 x 466 KB
    if shape == "one_reply":
        return [
            {"role": "user", "content": "Recite the manual."},
            {"role": "assistant", "content": "\n\n".join(texts)},
        ]
    messages = []
    for i, text in enumerate(texts):
        messages += [{"role": "user", "content": f"Explain {names[i % len(names)]!r}."}]
        messages += [{"role": "assistant", "content": text}]
    return messages


@pytest.mark.parametrize("shape", ["multi_turn", "one_reply"])
def test_a_5_mb_line_prepares_in_well_under_two_seconds(tmp_path, shape):
    messages = five_megabytes(shape)
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n", encoding="utf-8")
    assert path.stat().st_size > 5_000_000
    load_tokenizer(str(QUICKSTART_TOKENIZER))  # imports and a first load outside the timing
    basic = {"dataset": str(path), "cutoff_len": 2048, "cache_dir": str(tmp_path / "cache")}
    t0 = time.perf_counter()
    ds = SFTDataset(basic, {"model_name_or_path": str(QUICKSTART_TOKENIZER)}, None, workers=1)
    seconds = time.perf_counter() - t0
    assert ds.built and len(ds) == 1 and ds.num_skipped == 0
    item = ds[0]
    assert len(item["input_ids"]) == 2048 and (item["labels"] != IGNORE_INDEX).any()
    assert seconds < 2.0, f"preparing the 5 MB line took {seconds:.2f} s"
