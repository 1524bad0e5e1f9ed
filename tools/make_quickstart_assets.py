"""Write the quickstart corpus and tokenizer (deterministic; running it twice gives identical files).

Outputs, relative to the repository root:
- ``examples/quickstart/data/python_reference.jsonl``: one ``{"id": <topic>, "text": <text>}`` line per
  topic of the Python reference manual that ships with CPython (``pydoc_data.topics``), sorted by topic.
  The text depends on the Python version that runs this script.
- ``examples/quickstart/data/python_reference_chat.jsonl``: one SFT conversation per topic
  (``{"messages": [system, user, assistant]}``); the reply is the topic's opening paragraphs.
- ``examples/quickstart/tokenizer/``: a byte-level BPE tokenizer (vocabulary 4096) trained on that text,
  with ``<|endoftext|>`` (eos and pad), ``<|im_start|>``, ``<|im_end|>`` and a ChatML chat template whose
  ``{% generation %}`` blocks mark the assistant tokens for SFT.

Usage: ``python tools/make_quickstart_assets.py [--vocab-size 4096]``
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA_FILE = REPO / "examples" / "quickstart" / "data" / "python_reference.jsonl"
CHAT_FILE = REPO / "examples" / "quickstart" / "data" / "python_reference_chat.jsonl"
TOKENIZER_DIR = REPO / "examples" / "quickstart" / "tokenizer"

try:
    from mm_data_text.tokenizer_build import train_bytelevel_bpe
except ImportError:  # running from a checkout without the package installed
    sys.path.insert(0, str(REPO / "packages" / "mm-data-text" / "src"))
    from mm_data_text.tokenizer_build import train_bytelevel_bpe


def reference_topics() -> list[tuple[str, str]]:
    """(topic, text) pairs of the Python reference manual, sorted by topic name."""
    from pydoc_data.topics import topics

    return [(name, topics[name].strip() + "\n") for name in sorted(topics)]


def chat_record(name: str, text: str, max_chars: int = 700) -> dict:
    """An SFT conversation: a question about a topic, answered by the topic's opening paragraphs."""
    paragraphs = [p.strip("\n").rstrip() for p in text.split("\n\n") if p.strip()]
    body = [p for p in paragraphs if not set(p.splitlines()[-1]) <= set("*=-")]
    reply = ""
    for paragraph in body:
        if reply and len(reply) + len(paragraph) > max_chars:
            break
        reply = f"{reply}\n\n{paragraph}" if reply else paragraph
    return {
        "messages": [
            {"role": "system", "content": "You answer questions about the Python language."},
            {"role": "user", "content": f'What does the Python reference manual say about "{name}"?'},
            {"role": "assistant", "content": reply},
        ]
    }


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=4096)
    args = parser.parse_args(argv)
    records = reference_topics()
    write_jsonl([{"id": name, "text": text} for name, text in records], DATA_FILE)
    write_jsonl([chat_record(name, text) for name, text in records], CHAT_FILE)
    train_bytelevel_bpe([text for _, text in records], args.vocab_size, TOKENIZER_DIR)
    for path in [DATA_FILE, CHAT_FILE, *sorted(TOKENIZER_DIR.iterdir())]:
        print(f"{path.relative_to(REPO)}  {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
