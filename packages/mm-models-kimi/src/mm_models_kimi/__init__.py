"""Kimi-family models for mm, registered through the ``mm.models`` entry-point group."""

__version__ = "0.1.0"
