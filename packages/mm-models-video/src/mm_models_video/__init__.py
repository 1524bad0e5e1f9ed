"""Video diffusion transformers for mm (``wan2_2``, ``ltx2``), found through entry points.

The model classes need diffusers (``pip install 'mm-models-video[diffusers]'``); they are imported only when
a config names them, so this package imports without it.
"""

__version__ = "0.1.0"
