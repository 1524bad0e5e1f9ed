"""CosyVoice3 speech generation for mm: three stages trained separately on one speech store.

- ``cosyvoice3_lm`` (:mod:`~mm_models_cosyvoice.lm`): the Qwen2-based text-speech language model (text ->
  25 Hz speech tokens);
- ``cosyvoice3_flow`` (:mod:`~mm_models_cosyvoice.flow`): the flow-matching acoustic model with its DiT
  estimator (speech tokens + speaker -> 50 Hz log-mel);
- ``cosyvoice3_hift`` / ``cosyvoice3_hift_disc`` (:mod:`~mm_models_cosyvoice.hift`,
  :mod:`~mm_models_cosyvoice.discriminator`) with the ``cosyvoice_vocoder`` task: the HiFT vocoder
  (log-mel -> 24 kHz wave) and its GAN discriminators.

The data they train on (the speech store, the one log-mel, the ``cosyvoice_speech`` dataset and its collators)
is mm-data-audio's :mod:`mm_data_audio.cosyvoice`; the model modules here are imported only when used (entry
points), so reading or writing a store needs no model code.
"""

__version__ = "0.1.0"
