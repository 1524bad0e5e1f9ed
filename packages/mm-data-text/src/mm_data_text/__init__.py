"""Text datasets for mm: packed pretraining (txt/jsonl/parquet) and chat SFT, with their collators.

Registered through entry points (see the package README); importing this package imports nothing heavy.
"""

__version__ = "0.1.0"
