"""Activation offload: tensors that autograd saves inside chosen modules go to host memory during forward
and come back for backward.

Mechanism: :class:`torch.autograd.graph.saved_tensors_hooks`, entered in a forward pre-hook of each chosen
module and left in its forward hook. On an accelerator each saved tensor is copied into pinned host memory on
a side stream (so the copy overlaps compute) and its device memory is released; in backward, the first
tensor a block asks for brings the whole block back, and the block that backward reaches next is copied
back on the side stream ahead of time (prefetch). Parameters (including FSDP2's gathered ones) and tensors
smaller than ``min_bytes`` are never offloaded. On a CPU run the activations are already in host memory, so
nothing moves unless ``copy_host_tensors`` is set (which exercises the same pack/unpack path by copying).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.hooks import RemovableHandle


@dataclass
class OffloadStats:
    """What the offloader moved (summed over the run)."""

    tensors: int = 0
    bytes: int = 0
    kept_tensors: int = 0
    prefetched_blocks: int = 0


class _Saved:
    """One offloaded tensor: the host copy, and the device copy while one exists."""

    __slots__ = ("host", "device", "event", "block")

    def __init__(self, host: torch.Tensor, block: _Block) -> None:
        self.host = host
        self.device: torch.Tensor | None = None
        self.event: Any = None
        self.block = block


@dataclass(eq=False)
class _Block:
    """The tensors one forward call of one module saved."""

    name: str
    items: list[_Saved] = field(default_factory=list)
    param_ptrs: set[int] | None = None
    fetched: bool = False  # copy back to the device started
    reached: bool = False  # backward has asked for one of its tensors


class ActivationOffloader:
    """Offloads saved activations of the modules passed to :meth:`attach`; one instance per model."""

    def __init__(
        self,
        device_type: str,
        *,
        min_bytes: int = 1024,
        prefetch: bool = True,
        copy_host_tensors: bool = False,
    ) -> None:
        self.device_type = device_type
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self.copy_host_tensors = copy_host_tensors
        self.stats = OffloadStats()
        self._accel = device_type != "cpu"
        # torch.cuda / torch.npu and their Stream: no common static type; used only when self._accel
        self._mod: Any = None
        self._stream: Any = None
        if self._accel:
            self._mod = getattr(torch, device_type)
            self._stream = self._mod.Stream()
        self._blocks: list[_Block] = []  # forward order of blocks still waiting for backward
        self._active: list[tuple[_Block, saved_tensors_hooks]] = []
        self._handles: list[RemovableHandle] = []

    # ----------------------------------------------------------------------------------------- wiring
    def attach(self, modules: Iterable[tuple[str, nn.Module]]) -> int:
        """Offload the activations saved inside each named module (call before ``fully_shard``)."""
        count = 0
        for name, module in modules:
            self._handles.append(module.register_forward_pre_hook(self._make_enter(name, module)))
            self._handles.append(module.register_forward_hook(self._exit))
            count += 1
        return count

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _make_enter(self, name: str, module: nn.Module) -> Callable[[nn.Module, Any], None]:
        def enter(_module: nn.Module, _args: Any) -> None:
            if not torch.is_grad_enabled():
                return
            block = _Block(name)
            block.param_ptrs = None
            hooks = saved_tensors_hooks(
                lambda t: self._pack(t, block, module), lambda packed: self._unpack(packed)
            )
            hooks.__enter__()
            self._active.append((block, hooks))
            self._blocks.append(block)

        return enter

    def _exit(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        if not self._active or not torch.is_grad_enabled():
            return
        block, hooks = self._active.pop()
        hooks.__exit__(None, None, None)
        if not block.items:
            self._blocks.remove(block)

    # ------------------------------------------------------------------------------------ pack/unpack
    def _is_param(self, t: torch.Tensor, block: _Block, module: nn.Module) -> bool:
        if isinstance(t, nn.Parameter):
            return True
        if block.param_ptrs is None:  # gathered FSDP2 parameters exist only once the forward has begun
            block.param_ptrs = {p.untyped_storage().data_ptr() for p in module.parameters()}
        return t.untyped_storage().data_ptr() in block.param_ptrs

    def _pack(self, t: torch.Tensor, block: _Block, module: nn.Module) -> torch.Tensor | _Saved:
        nbytes = t.numel() * t.element_size()
        on_host = t.device.type == "cpu"
        if (
            nbytes < self.min_bytes
            or (on_host and not self.copy_host_tensors)
            or t.device.type == "meta"
            or self._is_param(t, block, module)
        ):
            self.stats.kept_tensors += 1
            return t
        if on_host:
            saved = _Saved(t.detach().clone(), block)
        else:
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            stream = self._stream
            stream.wait_stream(self._mod.current_stream())
            with self._mod.stream(stream):
                host.copy_(t.detach(), non_blocking=True)
            t.record_stream(stream)  # the device memory is reused only after the copy has finished
            saved = _Saved(host, block)
        block.items.append(saved)
        self.stats.tensors += 1
        self.stats.bytes += nbytes
        return saved

    def _fetch(self, block: _Block) -> None:
        """Start copying a block's tensors back to the device on the side stream."""
        if block.fetched:
            return
        block.fetched = True
        if not self._accel:
            return
        device = torch.device(self.device_type, self._mod.current_device())
        stream = self._stream
        stream.wait_stream(self._mod.current_stream())
        with self._mod.stream(stream):
            for item in block.items:
                if item.device is None:
                    item.device = item.host.to(device, non_blocking=True)
                    item.event = self._mod.Event()
                    item.event.record(stream)

    def _unpack(self, packed: torch.Tensor | _Saved) -> torch.Tensor:
        if not isinstance(packed, _Saved):
            return packed
        block = packed.block
        if not block.reached:
            block.reached = True
            self._fetch(block)
            # backward reaches blocks in reverse forward order: bring the one before this back now
            if block in self._blocks:
                i = self._blocks.index(block)
                if self.prefetch and i > 0:
                    self._fetch(self._blocks[i - 1])
                    self.stats.prefetched_blocks += 1
                del self._blocks[i]
        if not self._accel:
            return packed.host
        if packed.device is None:  # unpacked a second time (retain_graph): copy again
            packed.device = packed.host.to(torch.device(self.device_type, self._mod.current_device()))
            packed.event = None
        current = self._mod.current_stream()
        if packed.event is not None:
            current.wait_event(packed.event)
            packed.device.record_stream(current)
        out, packed.device = packed.device, None
        return out
