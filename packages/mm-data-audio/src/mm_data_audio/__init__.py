"""Audio datasets and collators for mm (``audio_sft``, ``asr_manifest``, ``audio``), found through entry
points."""

__version__ = "0.1.0"
