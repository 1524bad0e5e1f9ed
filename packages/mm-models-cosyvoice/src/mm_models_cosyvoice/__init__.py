"""CosyVoice3 speech generation for mm: three stages trained separately on one speech store.

- ``cosyvoice3_lm`` (:mod:`~mm_models_cosyvoice.lm`): the Qwen2-based text-speech language model (text ->
  25 Hz speech tokens);
- ``cosyvoice3_flow`` (:mod:`~mm_models_cosyvoice.flow`): the flow-matching acoustic model with its DiT
  estimator (speech tokens + speaker -> 50 Hz log-mel);
- ``cosyvoice3_hift`` / ``cosyvoice3_hift_disc`` (:mod:`~mm_models_cosyvoice.hift`,
  :mod:`~mm_models_cosyvoice.discriminator`) with the ``cosyvoice_vocoder`` task: the HiFT vocoder
  (log-mel -> 24 kHz wave) and its GAN discriminators.

Data: :mod:`~mm_models_cosyvoice.store` (the speech store), :mod:`~mm_models_cosyvoice.audio` (the one
log-mel), :mod:`~mm_models_cosyvoice.data` (the ``cosyvoice_speech`` dataset and its collators). The model
modules are imported only when used (entry points), so reading or writing a store needs no model code.
"""

from mm_models_cosyvoice.audio import log_mel, read_wav, write_wav
from mm_models_cosyvoice.store import SpeechRecord, StoreMeta, Utterance, read_index, read_meta, write_store

__version__ = "0.1.0"

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
