"""Video diffusion transformers for mm (``wan2_2``, ``ltx2``), found through entry points.

The model classes are diffusers' transformers (subclasses); diffusers is a dependency of this package.
"""

__version__ = "0.1.0"
