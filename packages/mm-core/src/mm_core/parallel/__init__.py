"""Config to mm_parallel: the layer that reads the YAML's ``parallel`` and ``model`` blocks (and the model's
plan) and calls mm_parallel with explicit modules and meshes. It takes those config parts, never the whole
run config.

Mirrors ``mm_parallel``: ``state`` builds the meshes; ``plan`` resolves the one build plan of a model
(``resolve_build``: every decision once, each naming its YAML key), read by ``apply`` (which shards the
model by it: FSDP2 units, meta-device materialisation), ``context`` (context parallelism), ``experts``
(expert parallelism), ``memory`` (recompute/offload/prefetch, the chunked loss head), ``compile``, and
``estimate`` / ``summary`` (the per-rank memory estimate and the lines ``mm check`` and the workers print).
"""
