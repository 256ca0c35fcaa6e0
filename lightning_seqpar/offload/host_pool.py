"""Where offloaded activations wait for their backward: host memory, with every byte moved counted.

A tensor autograd saves inside an offloaded module is *packed* into a :class:`HostCopy` (a copy in host memory) and
*unpacked* (copied back to the device) when its backward asks for it; the device memory is freed when nothing else
holds it. On CUDA the copy out is made into pinned memory on a side stream that waits for the compute stream, the
device tensor is kept by the allocator until that copy is done (``record_stream``), and the copy back waits for it
(an event), so no host synchronization is made in either direction. On CPU the device *is* the host: the same path
makes its copies with the dispatch modes of this process set aside (:func:`~lightning_seqpar._compat.
outside_dispatch_modes`), so the memory trackers (:mod:`lightning_seqpar.memory.tracker`, :mod:`~.memory.peak`)
count what the offload frees and what it brings back, exactly as a GPU's allocator would see them.

**Prefetch, one layer ahead.** The copies a layer's forward makes are one :class:`LayerForward`, linked to the one
the layer before it made in the same forward. When the backward first reads a copy of layer i, every copy of layer
i − 1 still to be read is brought back at once (on CUDA on the side stream, which the reading waits for with an
event), so its copies back overlap layer i's backward instead of stalling layer i − 1's. The cost is one layer's
offloaded bytes on the device ahead of their backward (:attr:`HostPool.prefetched`; the planner counts it). Copies of
different micro-batches, or of a pipeline stage's chunks that are not adjacent layers, are never linked.

The pool is one rank's; whoever offloads owns it and passes it to the layers (no global state). Megatron-Core's
fine-grained activation offloading (``--offload-modules``) and torchtune's ``OffloadActivations`` move the same
tensors through the same ``torch.autograd.graph.saved_tensors_hooks``.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_seqpar._compat import outside_dispatch_modes, tensor_version
from lightning_seqpar.memory.saved_tensors import Packer, saved_tensor_policy


def same_layout(t: Tensor, device: torch.device, pin_memory: bool = False) -> Tensor:
    """An empty tensor on ``device`` with ``t``'s sizes and strides. ``torch.empty_like`` (and ``Tensor.to``) keep the
    strides of a dense tensor only: a view with gaps (a chunk of a fused gate/up projection's output, ``[n, f]`` of
    rows ``2f`` apart) would come back contiguous, and the backward reading it would run other kernels, in another
    summation order, than on the original. Its storage spans the view's extent (a little more than its elements)."""
    if t.is_contiguous() or torch.empty_like(t, device="meta").stride() == t.stride() or any(st == 0 for st, n in zip(t.stride(), t.shape) if n > 1):
        return torch.empty_like(t, device=device, pin_memory=pin_memory)  # dense, or broadcast (overlapping)
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device, pin_memory=pin_memory)


class HostCopy:
    """One saved tensor waiting in host memory: its copy, the device it came from, the copy's bytes.

    ``host`` keeps the tensor's strides (:func:`same_layout`), so the backward that reads it runs the kernels it would
    have run on the original.
    """

    __slots__ = ("host", "device", "nbytes", "ready", "back", "back_ready", "readers", "forward", "__weakref__")

    def __init__(self, host: Tensor, device: torch.device, nbytes: int, ready: Any) -> None:
        self.host, self.device, self.nbytes, self.ready = host, device, nbytes, ready
        self.back: Optional[Tensor] = None  # the tensor brought back, until its last reader has it
        self.back_ready: Any = None  # CUDA: the event after a prefetch's copy back (made on the side stream)
        self.readers = 0  # backward nodes that saved it and have not read it back yet
        self.forward: Optional[LayerForward] = None  # the layer forward that made it (prefetch)


class LayerForward:
    """The copies one layer's forward made (weakly: autograd owns them), and the forward of the layer before it in the
    same model forward (``previous``), whose copies are brought back when the backward first reads one of these."""

    __slots__ = ("index", "modules", "copies", "previous", "read", "__weakref__")

    def __init__(self, index: int, module: str, previous: Optional["LayerForward"]) -> None:
        self.index, self.modules, self.previous = index, {module}, previous
        self.copies: list[weakref.ref] = []
        self.read = False


class HostPool:
    """Copies of saved tensors in host memory, with the bytes moved each way counted (bytes of tensor elements).

    Args:
        device: the device whose tensors are offloaded (``cuda``: pinned memory and a side stream; ``cpu``: the
            counted pool described in the module docstring).

    Attributes:
        bytes_out: bytes copied to the host since the pool was made.
        bytes_in: bytes copied back to the device.
        held: bytes held in host memory now (a copy is released when autograd frees what it saved).
        peak_held: the largest ``held``.
        copies_out / copies_in: how many tensors went each way.
        prefetched: of ``copies_in``, those brought back ahead of their reader (one layer ahead, module docstring).

    Args (continued):
        prefetch: bring a layer's copies back when the backward reaches the layer after it (default); ``False``:
            each copy comes back when its backward node reads it, on the compute stream.
    """

    def __init__(self, device: torch.device | str, prefetch: bool = True) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.prefetch = prefetch
        self.bytes_out = self.bytes_in = self.held = self.peak_held = 0
        self.copies_out = self.copies_in = self.prefetched = 0
        self._stream: Optional[Any] = None
        self._last: Optional[LayerForward] = None  # the layer forward that offloaded last

    def counts(self) -> dict[str, int]:
        """The counters as plain integers (what a test or a report reads)."""
        return {"bytes_out": self.bytes_out, "bytes_in": self.bytes_in, "held": self.held,
                "peak_held": self.peak_held, "copies_out": self.copies_out, "copies_in": self.copies_in,
                "prefetched": self.prefetched}

    def layer_forward(self, index: int, module: str, repeats: bool = False) -> Optional[LayerForward]:
        """The :class:`LayerForward` a region of ``module`` in layer ``index`` (its place in the model's layers)
        offloads into: the last one while the same layer's forward goes on (a module not seen in it yet, or one whose
        region ``repeats`` within a forward: the experts' regions, once per expert), else a new one, linked to the
        last when that was the layer just before (``index − 1``) in the same forward. ``None`` without prefetch."""
        if not self.prefetch:
            return None
        last = self._last
        if last is not None and last.index == index and (repeats or module not in last.modules):
            last.modules.add(module)
            return last
        self._last = LayerForward(index, module, last if last is not None and last.index == index - 1 else None)
        return self._last

    def offload(self, t: Tensor) -> HostCopy:
        """Copy ``t`` to host memory (asynchronously on CUDA); the device tensor may be freed as soon as its other
        holders let go."""
        nbytes = t.numel() * t.element_size()
        if self.cuda:
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream(t.device))  # t is written on the compute stream
            with torch.cuda.stream(stream):
                host = same_layout(t, torch.device("cpu"), pin_memory=True)
                host.copy_(t, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(stream)
            t.record_stream(stream)  # the allocator keeps t's memory until the copy has read it
        else:
            with outside_dispatch_modes():  # the host copy is not device memory: the trackers must not see it
                host = same_layout(t, t.device)
                host.copy_(t)
            ready = None
        copy = HostCopy(host, t.device, nbytes, ready)
        self.bytes_out += nbytes
        self.copies_out += 1
        self.held += nbytes
        self.peak_held = max(self.peak_held, self.held)
        weakref.finalize(copy, self._release, nbytes)
        return copy

    def reload(self, copy: HostCopy) -> Tensor:
        """The tensor ``copy`` holds, on its device again. A tensor saved by several backward nodes comes back once:
        the copy holds it until the last of them has read it."""
        copy.readers -= 1
        if copy.forward is not None and not copy.forward.read:  # the backward reached this layer: fetch the next
            copy.forward.read = True
            if copy.forward.previous is not None:
                self._prefetch(copy.forward.previous)
        back = copy.back
        if back is not None:
            if self.cuda:
                stream = torch.cuda.current_stream(copy.device)
                if copy.back_ready is not None:
                    stream.wait_event(copy.back_ready)  # the prefetch's copy back has finished
                    copy.back_ready = None
                back.record_stream(stream)  # made on the side stream, read on this one
            if copy.readers <= 0:
                copy.back = None
            return back
        if self.cuda:
            torch.cuda.current_stream(copy.device).wait_event(copy.ready)  # the copy out has finished
            back = same_layout(copy.host, copy.device)
            back.copy_(copy.host, non_blocking=True)  # ordered before the backward kernels that read it
        else:
            back = same_layout(copy.host, copy.device)  # made under the dispatch modes: it is device memory again
            back.copy_(copy.host)
        if copy.readers > 0:
            copy.back = back
        self.bytes_in += copy.nbytes
        self.copies_in += 1
        return back

    def _prefetch(self, forward: LayerForward) -> None:
        """Bring back every copy of ``forward`` that a backward node is still to read (counted as it comes)."""
        for ref in forward.copies:
            copy = ref()
            if copy is None or copy.back is not None or copy.readers <= 0:
                continue
            if self.cuda:
                stream = self._side_stream()  # after this copy's way out, made on the same stream
                with torch.cuda.stream(stream):
                    copy.back = same_layout(copy.host, copy.device)
                    copy.back.copy_(copy.host, non_blocking=True)
                    copy.back_ready = torch.cuda.Event()
                    copy.back_ready.record(stream)
            else:
                copy.back = same_layout(copy.host, copy.device)  # device memory again, as the trackers see it
                copy.back.copy_(copy.host)
            self.bytes_in += copy.nbytes
            self.copies_in += 1
            self.prefetched += 1

    def _release(self, nbytes: int) -> None:
        self.held -= nbytes

    def _side_stream(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def packer(self, keep: set[int], forward: Optional[LayerForward] = None) -> Packer:
        """A saved-tensor packer (:class:`~lightning_seqpar.memory.saved_tensors.Packer`) that offloads every tensor
        to this pool, except those whose storage's address is in ``keep`` (parameters: they stay where they are) and
        those not on the pool's device. A tensor saved twice within one region is copied once. ``forward``: the
        layer forward the copies belong to (:meth:`layer_forward`; ``None``: never prefetched)."""
        # (tensor, its copy) by identity of what it views: the tensor is held until the region ends, so no other
        # tensor can take its address (and key) meanwhile
        seen: dict[tuple, tuple[Tensor, HostCopy]] = {}

        def pack(t: Tensor) -> Any:
            if t.device != self.device:  # a host tensor on a GPU rank: nothing to move
                return t
            storage = t.untyped_storage()
            if storage.data_ptr() in keep or t.numel() == 0:
                return t
            key = (storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, tensor_version(t))
            if key not in seen:
                seen[key] = (t, self.offload(t))
                if forward is not None:
                    seen[key][1].forward = forward
                    forward.copies.append(weakref.ref(seen[key][1]))
            copy = seen[key][1]
            copy.readers += 1
            return copy

        def unpack(packed: Any) -> Tensor:
            return self.reload(packed) if isinstance(packed, HostCopy) else packed

        # autograd keeps the pack hook (and so this dict) as long as what it saved: emptied when the region ends
        return Packer(pack, unpack, seen.clear)

    def saving(self, keep: set[int]) -> Any:
        """A context within which every tensor autograd saves is offloaded to this pool (:meth:`packer`; no
        prefetch)."""
        return saved_tensor_policy(None, self.packer(keep))
