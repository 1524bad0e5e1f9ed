"""mm core: configuration, registries, parallel state, checkpoints, trainer and CLI."""

__version__ = "0.1.0"
