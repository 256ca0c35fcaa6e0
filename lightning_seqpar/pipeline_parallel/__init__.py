"""Pipeline parallelism: stage layout, schedules, point-to-point transfers and their executor."""

from lightning_seqpar.pipeline_parallel.executor import PipelineExecutor, StepResult
from lightning_seqpar.pipeline_parallel.layout import StageLayout
from lightning_seqpar.pipeline_parallel.lightning_step import PipelinedSteps, split_microbatches
from lightning_seqpar.pipeline_parallel.p2p import StageTransport, TransferLog
from lightning_seqpar.pipeline_parallel.schedules import (
    SCHEDULES,
    Action,
    build_schedule,
    check_microbatches,
    resolve_schedule,
    simulate,
)
from lightning_seqpar.pipeline_parallel.stage import RemoteLayer, StageRuntime, split_stages

__all__ = [
    "SCHEDULES",
    "Action",
    "PipelineExecutor",
    "PipelinedSteps",
    "RemoteLayer",
    "StageLayout",
    "StageRuntime",
    "StageTransport",
    "StepResult",
    "TransferLog",
    "build_schedule",
    "check_microbatches",
    "resolve_schedule",
    "simulate",
    "split_microbatches",
    "split_stages",
]
