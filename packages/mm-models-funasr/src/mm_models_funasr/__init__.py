"""FunASR models for mm, registered through the ``mm.models`` entry-point group: ``fun_asr_nano``
(transformers' Fun-ASR-Nano) and ``paraformer`` (funasr's Paraformer behind an adapter; the optional extra
``mm-models-funasr[paraformer]``). Importing this package never imports funasr."""

__version__ = "0.1.0"
