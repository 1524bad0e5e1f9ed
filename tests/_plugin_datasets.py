"""Dataset plugins as a third-party package writes them, loaded with ``training.plugin: [_plugin_datasets]``.

``reference_lines``: variable-length samples of real text — the lines of the Python language reference
(``pydoc_data.topics``, shipped with Python) tokenised with the quickstart tokenizer, every token a label.
It gives ``sample_lengths()`` for token-budget batching and batches with the ``sft`` collator (right-padded,
labels -100 on the padding).
"""

from __future__ import annotations

from collections.abc import Mapping
from pydoc_data.topics import topics
from typing import Any

import numpy as np
import torch

from mm_core.data.params import BASIC, PREPROCESS, positive_int, read_params, string
from mm_core.registry import data_register

BASIC_FIELDS = {
    "num_samples": positive_int(200),
    "min_tokens": positive_int(2),
    "cutoff_len": positive_int(32),
}
PREPROCESS_FIELDS = {"model_name_or_path": string()}


def reference_lines() -> list[str]:
    """Every non-blank line of the Python language reference, topics in sorted order."""
    return [line.strip() for name in sorted(topics) for line in topics[name].splitlines() if line.strip()]


@data_register.register("reference_lines")
class ReferenceLines(torch.utils.data.Dataset):
    """The first ``num_samples`` lines with at least ``min_tokens`` tokens, cut to ``cutoff_len`` tokens."""

    def __init__(
        self,
        basic_param: Mapping[str, Any] | None,
        preprocess_param: Mapping[str, Any] | None,
        dataset_param: Any = None,
        *,
        seed: int = 0,
    ) -> None:
        from transformers import AutoTokenizer

        basic = read_params(basic_param, BASIC_FIELDS, BASIC)
        pre = read_params(preprocess_param, PREPROCESS_FIELDS, PREPROCESS)
        tokenizer = AutoTokenizer.from_pretrained(pre["model_name_or_path"], local_files_only=True)
        self.pad_token_id = int(tokenizer.pad_token_id or 0)
        self.samples: list[list[int]] = []
        for line in reference_lines():
            ids = tokenizer(line, add_special_tokens=False)["input_ids"][: basic["cutoff_len"]]
            if len(ids) >= basic["min_tokens"]:
                self.samples.append(ids)
            if len(self.samples) == basic["num_samples"]:
                break

    def __len__(self) -> int:
        return len(self.samples)

    def sample_lengths(self) -> np.ndarray:
        return np.array([len(s) for s in self.samples], dtype=np.int64)

    def __getitem__(self, index: int) -> dict[str, Any]:
        ids = torch.tensor(self.samples[index], dtype=torch.long)
        return {"input_ids": ids, "labels": ids.clone(), "sample_id": int(index)}
