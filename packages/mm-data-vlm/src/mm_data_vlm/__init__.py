"""Vision-language datasets and collators for mm (``vlm_sft``, ``qwen3vl``), found through entry points."""

__version__ = "0.1.0"
