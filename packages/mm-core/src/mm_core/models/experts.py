"""Training subclasses of transformers mixture-of-experts models keep transformers' grouped GEMM experts.

transformers decides whether a model class may switch its experts implementation (``grouped_mm``, the default,
or the per-expert ``eager`` loop) by looking for the ``@use_experts_implementation`` decorator in the source
file of the class being built, and caches the answer on that class. A subclass defined in a plugin lives in
another file: built before its transformers class was ever asked, it is told "eager", and its MoE layers run
one small matmul per expert. :class:`TransformersExperts` answers for the subclass what transformers answers
for the transformers class it extends, whatever the build order.
"""

from __future__ import annotations


class TransformersExperts:
    """Mixin for a training subclass of a transformers MoE model: list it before the transformers class,
    ``class MyMoeForTraining(TransformersExperts, SomeMoeForCausalLM)``."""

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        """What transformers answers for the nearest base class defined in transformers."""
        for base in cls.__mro__[1:]:
            if base.__module__.startswith("transformers.models.") and hasattr(
                base, "_can_set_experts_implementation"
            ):
                return bool(base._can_set_experts_implementation())
        return False
