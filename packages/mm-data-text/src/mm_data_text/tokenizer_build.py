"""Train a small byte-level BPE tokenizer with ChatML special tokens and save it as a Hugging Face folder.

Used by ``tools/make_quickstart_assets.py`` and by the tests, so that nothing needs the network.
The saved folder loads with ``transformers.AutoTokenizer.from_pretrained(path)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from mm_core.data.bpe import write_bytelevel_bpe

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)

# Qwen-style ChatML. The {% generation %} block marks the tokens an SFT loss trains on: the assistant
# reply plus its <|im_end|>; the newline after <|im_end|> and the "<|im_start|>assistant\n" header are
# prompt. No default system prompt is inserted.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}"
    "{{- message['content'] + '<|im_end|>' -}}"
    "{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def train_bytelevel_bpe(
    texts: Iterable[str], vocab_size: int, out_dir: str | Path, chat_template: str = CHATML_TEMPLATE
) -> Path:
    """Train a deterministic byte-level BPE on ``texts`` and write tokenizer.json + tokenizer_config.json."""
    return write_bytelevel_bpe(
        texts, vocab_size, out_dir, special_tokens=SPECIAL_TOKENS, chat_template=chat_template
    )
