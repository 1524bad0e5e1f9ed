"""The token sequence the CosyVoice3 language model trains on: text and speech in one stream.

The LM has two input tables: Qwen2's own ``embed_tokens`` for text (and the instruction) and
``speech_embedding`` for the speech side, whose rows are the ``K`` speech tokens (``speech_vocab``, 6561
officially) followed by 200 special rows: ``sos = K``, ``eos = K + 1``, ``task_id = K + 2``, ``fill = K + 3``
(the rest unused). Its output head predicts over the same ``K + 200`` classes.

**Uni-stream** (the default): the inputs are ``[sos, instruct, text, task_id, s_1 .. s_S]``; the task_id
position predicts ``s_1``, each speech position the next one and the last one ``eos``; nothing before
task_id is predicted.

**Bi-stream** (``mix_ratio = (5, 15)``, chosen per sample when ``S × 5 > T_text × 15``): after
``[sos, instruct]`` come blocks of 5 text tokens followed by 15 speech tokens; the last text token of a
block predicts the block's first speech token and its last speech token predicts ``fill``; the final,
shorter text block is followed by ``task_id`` and the remaining speech, ending with ``eos`` as in uni-stream.
This teaches streaming text input (CosyVoice2/3's "bistream" mode).

**The layout mm sees.** :func:`lm_sequence` gives the inputs as one row of ids with a ``speech_mask``
(True where the id indexes ``speech_embedding``) and ``labels`` in mm's (Hugging Face's) convention: the
label at position ``p`` is what position ``p − 1`` predicts. One ``eos`` input is appended so that the last
prediction (``eos`` after the last speech token) has a label position; causal attention keeps that extra
input from changing any earlier position, and its own prediction is not trained. mm's token loss
(``loss_type: per_token_loss``) is then exactly upstream's loss: cross entropy averaged over every predicted
speech / fill / eos token of the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mm_core.train.loss import IGNORE_INDEX

#: special rows after the speech tokens in ``speech_embedding`` / the output head
SPECIAL_ROWS = 200
#: text tokens and speech tokens per bi-stream block (upstream's ``mix_ratio``)
MIX_RATIO = (5, 15)


@dataclass(frozen=True)
class SpeechIds:
    """The speech-side ids of a vocabulary of ``speech_vocab`` speech tokens."""

    speech_vocab: int

    @property
    def sos(self) -> int:
        return self.speech_vocab

    @property
    def eos(self) -> int:
        return self.speech_vocab + 1

    @property
    def task_id(self) -> int:
        return self.speech_vocab + 2

    @property
    def fill(self) -> int:
        return self.speech_vocab + 3

    @property
    def rows(self) -> int:
        """Rows of ``speech_embedding`` and classes of the output head."""
        return self.speech_vocab + SPECIAL_ROWS


@dataclass(frozen=True)
class LMSequence:
    """One training row: ``input_ids`` [N] (text ids where ``speech_mask`` is False, speech-table ids where
    it is True) and ``labels`` [N] (mm's convention, ``IGNORE_INDEX`` where nothing is predicted)."""

    input_ids: torch.Tensor
    speech_mask: torch.Tensor
    labels: torch.Tensor


def bistream_allowed(text_tokens: int, speech_tokens: int, mix_ratio: Sequence[int] = MIX_RATIO) -> bool:
    """Whether a sample may train bi-stream: more speech per text token than a block holds
    (``S / T_text > mix_ratio[1] / mix_ratio[0]``), so every full text block has its speech block."""
    return text_tokens > 0 and speech_tokens * mix_ratio[0] > text_tokens * mix_ratio[1]


def lm_sequence(
    instruct_ids: Sequence[int] | torch.Tensor,
    text_ids: Sequence[int] | torch.Tensor,
    speech_tokens: Sequence[int] | torch.Tensor,
    speech_vocab: int,
    *,
    bistream: bool = False,
    mix_ratio: Sequence[int] = MIX_RATIO,
) -> LMSequence:
    """The training row of one utterance (module docstring). ``bistream`` needs
    :func:`bistream_allowed`; ValueError otherwise."""
    ids = SpeechIds(speech_vocab)
    instruct = [int(t) for t in instruct_ids]
    text = [int(t) for t in text_ids]
    speech = [int(t) for t in speech_tokens]
    if bistream and not bistream_allowed(len(text), len(speech), mix_ratio):
        raise ValueError(
            f"bi-stream needs more than {mix_ratio[1]}/{mix_ratio[0]} speech tokens per text token; got "
            f"{len(speech)} speech and {len(text)} text tokens"
        )
    # (id, is_speech, target): the target is what this position predicts (upstream's alignment)
    rows: list[tuple[int, bool, int]] = [(ids.sos, True, IGNORE_INDEX)]
    rows += [(t, False, IGNORE_INDEX) for t in instruct]
    if bistream:
        n_text, n_speech = int(mix_ratio[0]), int(mix_ratio[1])
        block = 0
        while True:
            txt = text[block * n_text : (block + 1) * n_text]
            if len(txt) < n_text:
                break
            sp = speech[block * n_speech : (block + 1) * n_speech]
            rows += [(t, False, IGNORE_INDEX) for t in txt[:-1]] + [(txt[-1], False, sp[0])]
            rows += [(s, True, nxt) for s, nxt in zip(sp, sp[1:] + [ids.fill])]
            block += 1
        text = txt
        speech = speech[block * n_speech :]
    rows += [(t, False, IGNORE_INDEX) for t in text]
    rows.append((ids.task_id, True, speech[0] if speech else ids.eos))
    rows += [(s, True, nxt) for s, nxt in zip(speech, speech[1:] + [ids.eos])]
    rows.append((ids.eos, True, IGNORE_INDEX))  # the appended input that carries the last label
    input_ids = torch.tensor([r[0] for r in rows], dtype=torch.long)
    speech_mask = torch.tensor([r[1] for r in rows], dtype=torch.bool)
    targets = [r[2] for r in rows]
    labels = torch.tensor([IGNORE_INDEX] + targets[:-1], dtype=torch.long)
    return LMSequence(input_ids, speech_mask, labels)


def prompt_sequence(
    instruct_ids: Sequence[int] | torch.Tensor,
    text_ids: Sequence[int] | torch.Tensor,
    prompt_speech: Sequence[int] | torch.Tensor,
    speech_vocab: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inference prompt ``[sos, instruct, text, task_id, prompt speech]`` as ``(input_ids, speech_mask)``
    (the text should hold the prompt's transcript followed by the text to speak)."""
    ids = SpeechIds(speech_vocab)
    rows = [(ids.sos, True)] + [(int(t), False) for t in instruct_ids] + [(int(t), False) for t in text_ids]
    rows += [(ids.task_id, True)] + [(int(s), True) for s in prompt_speech]
    return (
        torch.tensor([r[0] for r in rows], dtype=torch.long),
        torch.tensor([r[1] for r in rows], dtype=torch.bool),
    )
