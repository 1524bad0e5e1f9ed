"""SFT preparation of one very long record (real text): encoding the whole conversation and then cutting it
to ``cutoff_len`` (the approach before mm_data_text.chat.encode_within) against cutting it before tokenising
(what the ``sft`` dataset's preparation does now). Each side runs in a fresh process, which reports its wall
time, its peak resident memory (``ru_maxrss``) and a hash of the ids and labels kept, to compare the sides.

Two shapes of a ~5 MB line, both from the Python reference manual (``pydoc_data.topics``):
- ``multi_turn``: alternating user questions and assistant answers (one topic each), ~1,700 messages;
- ``one_reply``: a short question and one ~5 MB assistant reply.

``tools/bench/data.py`` imports :func:`bench_sft_long_record`; run alone::

    python tools/bench/_sft_long.py [--tmp DIR] [--tokenizer DIR] [--cutoff-len 2048] [--mb 5]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
QUICKSTART_TOKENIZER = REPO / "examples" / "quickstart" / "tokenizer"
SHAPES = ("multi_turn", "one_reply")


def long_conversation(shape: str, target_bytes: int) -> list[dict[str, str]]:
    """A conversation of at least ``target_bytes`` bytes of contents from the Python reference manual."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    messages: list[dict[str, str]] = []
    size, i = 0, 0
    if shape == "one_reply":
        parts = []
        while size < target_bytes:
            parts.append(topics[names[i % len(names)]])
            size += len(parts[-1].encode("utf-8")) + 2
            i += 1
        return [
            {"role": "user", "content": "Recite the Python reference manual."},
            {"role": "assistant", "content": "\n\n".join(parts)},
        ]
    while size < target_bytes:
        name = names[i % len(names)]
        messages.append({"role": "user", "content": f"Explain the Python reference topic {name!r}."})
        messages.append({"role": "assistant", "content": topics[name]})
        size += sum(len(m["content"].encode("utf-8")) for m in messages[-2:])
        i += 1
    return messages


def _child(mode: str, path: str, tokenizer_dir: str, cutoff_len: int, cache_dir: str) -> dict[str, Any]:
    """One side, in this (fresh) process: imports first, then the timed preparation."""
    import hashlib
    import resource
    import time

    from transformers import AutoTokenizer  # noqa: F401 - imported before the baseline, like the rest

    from mm_data_text.chat import encode_conversation, uses_generation_markers
    from mm_data_text.sft import SFTDataset, record_messages
    from mm_data_text.sources import iter_jsonl
    from mm_data_text.tokenizer import load_tokenizer

    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if mode == "before":  # the former SFTDataset: parse, encode the whole conversation, cut
        tokenizer = load_tokenizer(tokenizer_dir)
        ((lineno, obj),) = list(iter_jsonl(Path(path)))
        messages = record_messages(obj, f"{path}:{lineno}", "messages")
        ids, labels = encode_conversation(
            tokenizer, messages, uses_generation_markers(tokenizer.chat_template)
        )
        total = len(ids)
        ids, labels = ids[:cutoff_len], labels[:cutoff_len]
    else:
        basic = {"dataset": path, "cutoff_len": cutoff_len, "cache_dir": cache_dir}
        ds = SFTDataset(basic, {"model_name_or_path": tokenizer_dir}, None, workers=1, overwrite=True)
        item = ds[0]
        ids, labels = item["input_ids"].tolist(), item["labels"].tolist()
        total = -1  # never tokenised whole
    seconds = time.perf_counter() - t0
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    digest = hashlib.sha256(json.dumps([ids, labels]).encode()).hexdigest()[:16]
    return {
        "time_s": round(seconds, 3),
        "peak_rss_mb": round(peak_kb / 1024, 1),
        "base_rss_mb": round(base_kb / 1024, 1),
        "added_rss_mb": round((peak_kb - base_kb) / 1024, 1),
        "tokens_whole": total,
        "kept": len(ids),
        "hash": digest,
    }


def _run_child(
    mode: str, path: Path, tokenizer_dir: Path, cutoff_len: int, cache_dir: Path
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        mode,
        str(path),
        str(tokenizer_dir),
        str(cutoff_len),
        str(cache_dir),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def bench_sft_long_record(
    tmp_dir: str | Path,
    *,
    tokenizer_dir: str | Path = QUICKSTART_TOKENIZER,
    cutoff_len: int = 2048,
    target_bytes: int = 5_000_000,
) -> dict[str, Any]:
    """Before/after time and peak RSS of preparing one ``target_bytes`` record, for each shape in ``SHAPES``;
    ``same`` says whether both kept the same ids and labels."""
    tmp = Path(tmp_dir)
    tmp.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"cutoff_len": cutoff_len, "tokenizer": str(tokenizer_dir), "cases": {}}
    for shape in SHAPES:
        messages = long_conversation(shape, target_bytes)
        path = tmp / f"sft_long_{shape}.jsonl"
        path.write_text(json.dumps({"messages": messages}) + "\n", encoding="utf-8")
        before = _run_child("before", path, Path(tokenizer_dir), cutoff_len, tmp / f"cache_{shape}")
        after = _run_child("after", path, Path(tokenizer_dir), cutoff_len, tmp / f"cache_{shape}")
        out["cases"][shape] = {
            "line_bytes": path.stat().st_size,
            "messages": len(messages),
            "before": before,
            "after": after,
            "same": before["hash"] == after["hash"],
        }
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        mode, path, tokenizer_dir, cutoff_len, cache_dir = sys.argv[2:7]
        print(json.dumps(_child(mode, path, tokenizer_dir, int(cutoff_len), cache_dir)))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tmp", default=None, help="working folder (default: a temporary one)")
    parser.add_argument("--tokenizer", default=str(QUICKSTART_TOKENIZER))
    parser.add_argument("--cutoff-len", type=int, default=2048)
    parser.add_argument("--mb", type=float, default=5.0, help="size of the record in MB (10^6 bytes)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        result = bench_sft_long_record(
            args.tmp or scratch,
            tokenizer_dir=args.tokenizer,
            cutoff_len=args.cutoff_len,
            target_bytes=int(args.mb * 1e6),
        )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
