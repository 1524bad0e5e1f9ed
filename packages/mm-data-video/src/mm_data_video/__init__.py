"""Video data for mm: the ``video_latents`` dataset and collator over latent stores, and
:func:`encode_clips`, which writes a store from raw clips with a frozen VAE and text encoder."""

from mm_data_video.encode import Clip, encode_clips, encode_video, t5_text_encoder
from mm_data_video.store import LatentRecord, StoreWriter, read_index

__version__ = "0.1.0"

__all__ = [
    "Clip",
    "LatentRecord",
    "StoreWriter",
    "encode_clips",
    "encode_video",
    "read_index",
    "t5_text_encoder",
]
