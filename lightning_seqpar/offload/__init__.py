"""Activation offload: the tensors named modules save for backward wait in host memory instead of on the device
(Megatron-Core's fine-grained activation offloading). The Lightning callback is
:class:`lightning_seqpar.ActivationOffload`; the bytes it moves are :func:`lightning_seqpar.memory.activations.
offloaded_activation_terms`."""

from lightning_seqpar.memory.conflicts import DENSE_OFFLOAD_MODULES, OFFLOAD_MODULES
from lightning_seqpar.offload.apply import LayerOffload, apply_offload, check_offload_modules
from lightning_seqpar.offload.host_pool import HostCopy, HostPool

__all__ = ["DENSE_OFFLOAD_MODULES", "OFFLOAD_MODULES", "HostCopy", "HostPool", "LayerOffload", "apply_offload",
           "check_offload_modules"]
