"""Every private Lightning or torch name the library uses, in one place.

Each entry says why it is needed and which public alternative was checked (Lightning 2.6, torch 2.13,
the versions ``setup.cfg`` pins and CI tests). ``tests/unit/test_layering.py`` fails if a private
name of either library is imported anywhere else, so an upgrade has one file to review.
"""

from __future__ import annotations

from typing import Any

import torch

# Starts the default process group from a Lightning ClusterEnvironment (MASTER_ADDR/PORT, rank,
# world size) and registers NCCL teardown at exit, exactly as Lightning's DDP and ModelParallel
# strategies do. Public alternative checked: torch.distributed.init_process_group, which would mean
# re-implementing the environment hand-off and the NCCL atexit handling.
from lightning.fabric.utilities.distributed import _init_dist_connection as init_dist_connection  # noqa: F401

# Fabric's launchers give each process cpu_count // local_processes intra-op threads; the Trainer's do
# not (4 processes on 2 cores ran 4.4x slower). Public alternative: torch.set_num_threads with our own
# copy of Lightning's suggestion, which would drift from Fabric's rule.
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed as set_num_threads_if_needed  # noqa: F401

# Strategy.reduce for self.log(sync_dist=True): Lightning's own reduction (mean/sum, group, non-float
# dtypes) as DDP uses it. No public equivalent in lightning.pytorch.
from lightning.fabric.utilities.distributed import _sync_ddp_if_available as sync_ddp_if_available  # noqa: F401

# Moves optimizer state to the device after setup, as every Lightning strategy does. No public equivalent.
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device  # noqa: F401

# Lightning's launchers: popen re-runs the script per rank (the `ddp` default), the multiprocessing one
# spawns/forks and returns rank 0's results to the main process. Lightning exposes no public launcher
# classes; its own strategies import these. lightning_seqpar.launcher overrides two of the latter's
# private methods (_collect_rank_zero_results, _wrapping_function): the hooks Lightning's own
# subclasses override; there is no public one.
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher as SubprocessScriptLauncher  # noqa: F401
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher as MultiProcessingLauncher  # noqa: F401
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput as WorkerOutput  # noqa: F401

# The live-activation tracker and the collective counter sit below autograd, where only a dispatch mode
# sees every op's outputs (saved_tensors_hooks miss checkpoint caches). torch documents TorchDispatchMode
# but keeps it in a private module; tree_flatten has no public module in torch 2.13 (torch.utils.pytree
# does not exist there).
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401
from torch.utils._pytree import tree_flatten  # noqa: F401


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``tensor``'s memory: a DTensor's local shard, else itself.

    Called inside a dispatch mode, where ``DTensor.to_local()`` (the public way) would dispatch again.
    """
    return getattr(tensor, "_local_tensor", tensor)


def reset_multihead_attention(module: torch.nn.MultiheadAttention) -> None:
    """``nn.MultiheadAttention``'s own initializer, for modules built on the meta device.

    torch names it ``_reset_parameters`` (no public ``reset_parameters`` on this module in torch 2.13).
    """
    module._reset_parameters()


def storage_key(storage: torch.UntypedStorage) -> int:
    """An identity of a storage that is equal for every view of it (what ``StorageWeakRef`` keys on).

    ``data_ptr()`` (public) is not an identity: distinct empty storages share 0.
    """
    return storage._cdata


__all__: list[Any] = [
    "MultiProcessingLauncher",
    "SubprocessScriptLauncher",
    "TorchDispatchMode",
    "WorkerOutput",
    "init_dist_connection",
    "local_tensor",
    "optimizers_to_device",
    "reset_multihead_attention",
    "set_num_threads_if_needed",
    "storage_key",
    "sync_ddp_if_available",
    "tree_flatten",
]


def hf_attention_implementation(config: object) -> str:
    """The attention kernel a Hugging Face config selects (``"eager"``, ``"sdpa"``, ...). transformers 5 keeps
    it in ``config._attn_implementation`` (the public ``attn_implementation`` is only a constructor argument)."""
    return getattr(config, "_attn_implementation", None) or "eager"
