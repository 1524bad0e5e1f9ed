"""Audio datasets and collators for mm (``audio_sft``, ``asr_manifest``, ``audio``; for text to speech
``tts_codes``; CosyVoice3's ``cosyvoice_speech`` with its collators), found through entry points."""

__version__ = "0.1.0"
