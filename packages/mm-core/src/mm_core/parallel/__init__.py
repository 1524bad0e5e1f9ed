"""Config to mm_parallel: the layer that reads the YAML's ``parallel`` block (and the model's plan) and calls
mm_parallel with explicit modules and meshes.

Mirrors ``mm_parallel``: ``state`` builds the meshes, ``apply`` shards the model (FSDP2 units, freeze,
meta-device materialisation), ``context`` wires context parallelism, ``experts`` expert parallelism,
``memory`` recompute/offload/prefetch, and ``estimate`` the per-rank memory estimate of ``mm check``.
"""
