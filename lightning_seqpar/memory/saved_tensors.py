"""What a region of a block saves for backward, decided per tensor: one ``torch.autograd.graph.saved_tensors_hooks``
pair for the two memory choices that act there (only the innermost pair of hooks runs, so they must be one).

- **A norm's output rebuilt** (recomputation by module, ``"layernorm"``; Megatron-Core's ``recompute_modules``): the
  input projections save the norm's output ``[s/t, b, h]``; instead they keep a :class:`RebuiltOutput` (the norm and
  its input, which the norm keeps for its own backward anyway) and the output is made again, without a graph, when
  their backward reads it — the same kernel on the same input under the same autocast state: the same bytes.
- **Activation offload** (:mod:`lightning_seqpar.offload`): every other tensor goes to the host pool's packer.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch
from torch import Tensor


class Packer(NamedTuple):
    """A saved-tensor packer: ``pack(t)`` (the tensor itself, or what stands for it), ``unpack(packed)``, and ``done()``
    when the region ends (its bookkeeping released)."""

    pack: Callable[[Tensor], Any]
    unpack: Callable[[Any], Tensor]
    done: Callable[[], None]


class Rebuild(NamedTuple):
    """A norm's output to rebuild in backward: the tensor, how it was made (``make(input)``: the norm, cast as the
    projections read it) and the norm's input."""

    output: Tensor
    make: Callable[[Tensor], Tensor]
    input: Tensor


class RebuiltOutput:
    """Stands for a norm's output in the saved tensors: made again from the kept input when backward reads it, once for
    all the nodes that saved it (or views of it: each gets its own view of the rebuilt output)."""

    __slots__ = ("make", "input", "autocast", "offset", "readers", "back")

    def __init__(self, rebuild: Rebuild) -> None:
        self.make, self.input = rebuild.make, rebuild.input
        device = rebuild.input.device.type
        self.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        self.offset = rebuild.output.storage_offset()
        self.readers = 0
        self.back: Optional[Tensor] = None

    def view(self, t: Tensor) -> "RebuiltView":
        self.readers += 1
        return RebuiltView(self, tuple(t.shape), t.stride(), t.storage_offset() - self.offset)

    def rebuild(self) -> Tensor:
        self.readers -= 1
        back = self.back
        if back is None:
            device, enabled, dtype = self.autocast
            with torch.no_grad(), torch.autocast(device, dtype, enabled=enabled):
                back = self.make(self.input)
        self.back = back if self.readers > 0 else None
        return back


class RebuiltView(NamedTuple):
    """A saved view of a norm's output (the projections may save it reshaped): its geometry over the output's."""

    output: RebuiltOutput
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def unpack(self) -> Tensor:
        return self.output.rebuild().as_strided(self.shape, self.stride, self.offset)


@contextlib.contextmanager
def saved_tensor_policy(rebuild: Optional[Rebuild], packer: Optional[Packer]) -> Iterator[None]:
    """Within: a tensor autograd saves that is ``rebuild.output`` is kept as a :class:`RebuiltOutput`; any other goes to
    ``packer`` (or is kept as it is)."""
    # the output's storage: what the projections save is it or a view of it (a reshape)
    target = (rebuild.output.untyped_storage().data_ptr(), rebuild.output.dtype) if rebuild is not None else None
    stand_in = RebuiltOutput(rebuild) if rebuild is not None else None

    def pack(t: Tensor) -> Any:
        if stand_in is not None and (t.untyped_storage().data_ptr(), t.dtype) == target:
            return stand_in.view(t)
        return packer.pack(t) if packer is not None else t

    def unpack(packed: Any) -> Tensor:
        if isinstance(packed, RebuiltView):
            return packed.unpack()
        return packer.unpack(packed) if packer is not None else packed

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        if packer is not None:
            packer.done()
