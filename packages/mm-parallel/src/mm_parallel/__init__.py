"""mm-parallel: parallelism building blocks on plain PyTorch.

Every function takes a module, a :class:`~torch.distributed.device_mesh.DeviceMesh` (or sub-mesh) and plain
arguments, so it can be used from any training loop. Nothing here knows about configs or registries.
"""

__version__ = "0.1.0"
