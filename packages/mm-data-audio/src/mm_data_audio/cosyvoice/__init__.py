"""CosyVoice3 speech data: the speech store (:mod:`.store`), the one log-mel of every stage (:mod:`.audio`),
the text-speech sequences of the language model (:mod:`.sequence`) and the ``cosyvoice_speech`` dataset with
its ``cosyvoice_lm`` / ``cosyvoice_flow`` / ``cosyvoice_vocoder`` collators (:mod:`.data`)."""

from mm_data_audio.cosyvoice.audio import log_mel, read_wav, write_wav
from mm_data_audio.cosyvoice.store import (
    SpeechRecord,
    StoreMeta,
    Utterance,
    read_index,
    read_meta,
    write_store,
)

__all__ = [
    "SpeechRecord",
    "StoreMeta",
    "Utterance",
    "log_mel",
    "read_index",
    "read_meta",
    "read_wav",
    "write_store",
    "write_wav",
]
