"""Pipeline parallelism: stage layout, schedules, point-to-point transfers and their executor.

A stage here is a slice of the user's own ``training_step`` (see :mod:`.stage`), which needs the
micro-batch (masks, targets) on every stage. ``torch.distributed.pipelining`` calls a stage module
with the received tensors only and infers shapes by running stages on meta tensors, where our
tensor-parallel collectives cannot run; so the schedules (GPipe, 1F1B, interleaved 1F1B, as in
Megatron-LM, and ZB-H1, ZB-V and DualPipeV, whose W actions run the weight gradients our layers deferred; ZB-V and
DualPipeV on two chunks per rank in a V) are per-rank action lists run by our executor over ``torch.distributed``
sends and receives.
Nothing here imports Lightning: :mod:`lightning_seqpar.lightning.pipelined_steps` runs a LightningModule's steps
through it.
"""

from lightning_seqpar.pipeline_parallel.comm_plan import Batch, Transfer, build_program
from lightning_seqpar.pipeline_parallel.config import PipelineConfig
from lightning_seqpar.pipeline_parallel.executor import PipelineExecutor, StepResult
from lightning_seqpar.pipeline_parallel.layout import StageLayout
from lightning_seqpar.pipeline_parallel.nccl_model import check_programs
from lightning_seqpar.pipeline_parallel.p2p import StageTransport, TransferLog
from lightning_seqpar.pipeline_parallel.schedules import (
    SCHEDULES,
    SPLIT_BACKWARD,
    Action,
    bubble_fraction,
    build_schedule,
    check_microbatches,
    resolve_schedule,
    simulate,
    splits_backward,
    trace_bubble_fraction,
)
from lightning_seqpar.pipeline_parallel.stage import RemoteLayer, StageOutput, StageRuntime, split_stages

__all__ = [
    "SCHEDULES",
    "SPLIT_BACKWARD",
    "Action",
    "Batch",
    "PipelineConfig",
    "PipelineExecutor",
    "RemoteLayer",
    "StageLayout",
    "StageOutput",
    "StageRuntime",
    "StageTransport",
    "StepResult",
    "Transfer",
    "TransferLog",
    "bubble_fraction",
    "build_program",
    "build_schedule",
    "check_programs",
    "check_microbatches",
    "resolve_schedule",
    "simulate",
    "splits_backward",
    "split_stages",
    "trace_bubble_fraction",
]
