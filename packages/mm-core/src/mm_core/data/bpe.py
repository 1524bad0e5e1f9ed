"""Train a small byte-level BPE tokenizer and save it as a Hugging Face folder, without the network.

Plugins and examples use it to make the tokenizers their tests and tiny recipes need; the folder loads
with ``transformers.AutoTokenizer.from_pretrained(path)``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path


def write_bytelevel_bpe(
    texts: Iterable[str],
    vocab_size: int,
    out_dir: str | Path,
    *,
    special_tokens: Sequence[str],
    chat_template: str,
) -> Path:
    """Train a deterministic byte-level BPE on ``texts`` and write tokenizer.json + tokenizer_config.json.

    ``special_tokens[0]`` is the end-of-text token (also used for padding); the others are additional
    special tokens (e.g. ChatML's ``<|im_start|>``/``<|im_end|>``, Qwen's vision markers)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts), trainer=trainer)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"), pretty=False)
    added = {
        str(tokenizer.token_to_id(tok)): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok in special_tokens
    }
    eos = special_tokens[0]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": list(special_tokens[1:]),
        "bos_token": None,
        "eos_token": eos,
        "pad_token": eos,
        "unk_token": None,
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "padding_side": "right",
        "chat_template": chat_template,
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    return out
