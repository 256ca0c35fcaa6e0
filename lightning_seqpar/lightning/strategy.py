"""``SeqParallelStrategy``: Megatron-style tensor + sequence parallelism for ordinary LightningModules."""

from __future__ import annotations

import signal
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Generator, Iterable, Literal, Mapping, Optional, Sequence, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.optim import Optimizer
from typing_extensions import override

from lightning_seqpar.checkpoint.writer import ShardedCheckpointWriter
from lightning_seqpar.lightning._compat import SubprocessScriptLauncher, optimizers_to_device, set_num_threads_if_needed
from lightning_seqpar.lightning.checkpoint_hooks import CheckpointingMixin, check_checkpoint_options
from lightning_seqpar.lightning.checkpoint_io import AtomicCheckpointIO
from lightning_seqpar.lightning.launcher import configure_launcher
from lightning_seqpar.lightning.parallelize import check_before_start, parallelize
from lightning_seqpar.lightning.preemption import add_preemption
from lightning_seqpar.lightning.pipelined_steps import PipelinedSteps, PipelinedStepsMixin, check_pipelined_module
from lightning_seqpar.lightning.precision import ShardAwareClipping, ShardAwarePrecisionPlugin, low_precision_residual
from lightning_seqpar.lightning.process_group import (
    ProcessGroupCollectives,
    as_timedelta,
    report_failed_collective,
    start_process_group,
)
from lightning_seqpar.optim.grad_sync import GradientSync
from lightning_seqpar.parallel import ParallelMesh, RNGTracker, validate_layout
from lightning_seqpar.pipeline_parallel import PipelineConfig
from lightning_seqpar.rewriting import Policy, RewritePlan


class SeqParallelStrategy(
    CheckpointingMixin, PipelinedStepsMixin, ProcessGroupCollectives, ShardAwarePrecisionPlugin, ParallelStrategy
):
    """Tensor (+ sequence) and pipeline parallel training of an ordinary LightningModule.

    ``setup_environment``: the process group and the ``(pp, dp, tp)`` mesh, tensor-parallel ranks fastest.
    ``setup``: rank 0's weights on every rank → the recognized blocks rewritten (:func:`lightning_seqpar.explain`
    shows which) → the layer stack split into pipeline stages → this rank's shards materialized
    (:mod:`.parallelize`) → precision → optimizers (sharded over data-parallel ranks with ``zero=1``). Each step
    runs the module's own steps, through the pipeline schedule when ``pp > 1`` (:mod:`.pipelined_steps`;
    docs/pipeline.md states the contract); gradients are then finalized over the mesh
    (:mod:`lightning_seqpar.optim`) and clipped by the norm of the whole unsharded gradient. Checkpoints hold the
    single-device state dict (:mod:`.checkpoint_hooks`).

    Args:
        tp: tensor-parallel size t (ranks sharing each layer).
        pp: pipeline-parallel size p (stages of the layer stack). The data-parallel size is ``world_size // (tp · pp)``.
        num_microbatches: m, micro-batches per batch under pipeline parallelism (default ``pp``), dividing the rank's batch.
        schedule: ``"1F1B"`` (default; with ``virtual_stages > 1`` the interleaved 1F1B), ``"gpipe"`` or
            ``"interleaved_1F1B"``.
        virtual_stages: v, model chunks per pipeline rank for the interleaved schedule.
        pipeline_split: layers of each of the ``pp·virtual_stages`` stages, in model order (default: equal).
        sequence_parallel: shard LayerNorm/dropout/residual activations along the sequence
            (Korthikanti et al. 2022 §4.2.2). Ignored when ``tp == 1``.
        loss_parallel: compute the reference GPT's loss on vocabulary-sharded logits.
        policies: extra :class:`~lightning_seqpar.Policy` objects for the user's own block classes.
        verify_rewrite: check the rewrite before training, without communication: a Hugging Face causal LM whole (a
            small copy on emulated tp ranks), other declared blocks once per class and configuration.
        seed: base seed of the dropout streams; default: rank 0's ``torch.initial_seed()``.
        start_method: ``"popen"`` (re-run the script per rank, like DDP), ``"spawn"`` or ``"fork"``.
        process_group_backend: default ``"nccl"`` on GPUs, ``"gloo"`` on CPUs.
        timeout: how long a collective may wait for a peer before the job fails (seconds or a
            ``timedelta``; default torch's 30 minutes). A stalled rank then ends the job with an error that
            names the collective that timed out, instead of hanging it.
        allow_non_finite_checkpoint: load checkpoints whose weights or optimizer state hold NaN/inf
            (refused by default: they are corrupt, or the run had diverged).
        allow_unverified_checkpoint: load a checkpoint whose manifest is gone, its files unchecked (refused by default).
        checkpoint_format: ``"sharded"`` (default): a directory written by every rank through
            ``torch.distributed.checkpoint``, which resumes under any other layout (:mod:`lightning_seqpar.checkpoint`);
            ``"full"``: one file of the single-device model and optimizer (small models; same pipeline layout).
        async_save: sharded format only: write checkpoints in a background thread while training goes on.
        zero: ``1`` shards the optimizer state over the data-parallel ranks (ZeRO-1,
            :mod:`lightning_seqpar.optim.distributed_optimizer`); ``0`` (default) replicates it.
        fp32_main_params: with ``zero=1`` and 16-bit parameters (``precision="bf16-true"``), update a float32 copy of
            each rank's element ranges and round it into the parameters (Megatron's main params: 4 bytes / d each).
        low_precision_residual: under ``bf16-mixed`` / ``16-mixed``, carry the residual stream (hidden states, pipeline
            transfers, norm inputs kept) in 16 bits, as Megatron does: Table 2's bytes, 16-bit residual additions.

    Raises:
        ValueError: ``timeout`` not positive; an unknown ``checkpoint_format`` or ``zero``; ``zero=1`` or
            ``async_save`` with ``checkpoint_format="full"``; ``fp32_main_params`` without ``zero=1``; ``tp``/``pp``
            not positive integers; world size not divisible by ``tp · pp``; ``low_precision_residual`` without
            autocast (at setup); a model with nothing to rewrite or with shapes that do not split t ways; under ``pp > 1``, an
            unknown schedule, fewer micro-batches than stages (or, interleaved, not a multiple of ``pp``), a
            layer count that does not split into the stages asked, a batch not divisible into micro-batches.
    """

    strategy_name = "seq_parallel"

    def __init__(
        self,
        tp: int = 1,
        pp: int = 1,
        num_microbatches: Optional[int] = None,
        schedule: str = "1F1B",
        virtual_stages: int = 1,
        pipeline_split: Optional[Sequence[int]] = None,
        sequence_parallel: bool = True,
        loss_parallel: bool = True,
        policies: Optional[Iterable[Policy]] = None,
        verify_rewrite: bool = True,
        seed: Optional[int] = None,
        start_method: Literal["popen", "spawn", "fork"] = "popen",
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Union[float, timedelta, None] = None,
        allow_non_finite_checkpoint: bool = False,
        allow_unverified_checkpoint: bool = False,
        checkpoint_format: Literal["sharded", "full"] = "sharded",
        async_save: bool = False,
        zero: Literal[0, 1] = 0,
        fp32_main_params: bool = False,
        low_precision_residual: bool = False,
    ) -> None:
        validate_layout(tp * pp, tp, pp)
        check_checkpoint_options(checkpoint_format, zero, async_save, fp32_main_params)
        self.pipeline_config = PipelineConfig.build(pp, num_microbatches, schedule, virtual_stages, pipeline_split)
        if start_method not in ("popen", "spawn", "fork"):
            raise ValueError(f"start_method must be 'popen', 'spawn' or 'fork', got {start_method!r}.")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
                         checkpoint_io=checkpoint_io or AtomicCheckpointIO(), precision_plugin=precision_plugin)
        self.tp, self.sequence_parallel, self.loss_parallel = tp, sequence_parallel, loss_parallel
        self.policies, self.verify_rewrite = list(policies or ()), verify_rewrite
        self._seed, self._start_method, self.process_group_backend = seed, start_method, process_group_backend
        self._timeout, self.allow_non_finite_checkpoint = as_timedelta(timeout), allow_non_finite_checkpoint
        self.allow_unverified_checkpoint = allow_unverified_checkpoint
        self.checkpoint_format, self.async_save, self.zero = checkpoint_format, async_save, zero
        self.fp32_main_params, self.low_precision_residual = fp32_main_params, low_precision_residual
        self._checkpoint_writer: Optional[ShardedCheckpointWriter] = None
        self._mesh: Optional[ParallelMesh] = None
        self.rng_tracker: Optional[RNGTracker] = None
        self.rewrite_plan: Optional[RewritePlan] = None
        self.pipeline: Optional[PipelinedSteps] = None
        self._remote_keys: list[str] = []  # state-dict keys of other pipeline stages
        self._parallelized: Optional[torch.nn.Module] = None
        self._initial_weights: Optional[Mapping[str, Any]] = None  # read into the shards as they are made
        self.grad_sync: Optional[GradientSync] = None  # the fit's data-parallel reduction (one owner)
        self.num_nodes = 1

    @property
    def pp(self) -> int:
        """p, the pipeline-parallel size asked for (``pipeline_config.pp``)."""
        return self.pipeline_config.pp

    @property
    def mesh(self) -> ParallelMesh:
        """The ``(pp, dp, tp)`` process groups of this rank."""
        if self._mesh is None:
            raise RuntimeError("Accessing the parallel mesh before processes have initialized is not allowed.")
        return self._mesh

    @property
    @override
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank]  # type: ignore[index]

    @property
    def num_processes(self) -> int:  # on this node
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Tensor-parallel peers must see the same batch: replicas are the data-parallel ranks only.
        return {"num_replicas": self.mesh.dp, "rank": self.mesh.data.rank}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # shards exist only after the rewrite

    @override
    def _configure_launcher(self) -> None:  # in Trainer(): a world that does not split fails there, before any rank
        validate_layout(self.num_nodes * self.num_processes, self.tp, self.pp)
        self._launcher = configure_launcher(self, self.cluster_environment, self._start_method, check_before_start)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        # Lightning's Fabric launchers do this; the Trainer's do not. Without it every process runs
        # cpu_count intra-op threads, and on CPU 4 processes on 2 cores ran 4.4x slower than with one each.
        set_num_threads_if_needed(self.num_processes)
        self.set_world_ranks()
        validate_layout(self.world_size, self.tp, self.pp)  # before any collective
        if self.process_group_backend is None:
            self.process_group_backend = "nccl" if self.root_device.type == "cuda" else "gloo"
        assert self.cluster_environment is not None
        self._failure_watch = start_process_group(self.cluster_environment, self.process_group_backend, self._timeout)
        self._mesh = ParallelMesh.build(self.tp, self.pp, self.root_device.type, timeout=self._timeout)
        plugin = self.precision_plugin
        assert isinstance(plugin, ShardAwareClipping)
        plugin.mesh = self._mesh
        self._start_checkpoint_writer()

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    @override
    def setup(self, trainer: Any) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if self.model is not self._parallelized:  # fit() then validate() on one trainer: rewritten once
            parallel = parallelize(
                self.model, self.mesh, self.root_device, seed=self._seed, broadcast=self.broadcast,
                sequence_parallel=self.sequence_parallel, loss_parallel=self.loss_parallel, policies=self.policies,
                verify=self.verify_rewrite, pipeline=self.pipeline_config, source=self._initial_weights,
            )
            self._initial_weights = None
            if self.low_precision_residual:
                low_precision_residual(self.model, self.precision_plugin)
            self.rng_tracker, self.rewrite_plan = parallel.rng_tracker, parallel.rewrite_plan
            self.pipeline, self._remote_keys = parallel.pipeline, parallel.remote_keys
            self._parallelized = self.model
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            add_preemption(trainer)  # SIGTERM: a checkpoint at a step every rank agrees on (no collective in a handler)
            if self.pipeline is not None:
                check_pipelined_module(self.lightning_module)
            self.setup_optimizers(trainer)
            if self.grad_sync is not None:
                self.grad_sync.remove()  # a second fit: the previous buckets' hooks go
            self.grad_sync = GradientSync(self.model, self.optimizers, self.lr_scheduler_configs, self.mesh, self.zero,
                                          self.pipeline is not None, self.fp32_main_params)
            self.optimizers = self.grad_sync.optimizers
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Where Lightning runs ``configure_model()``: on the meta device, so no rank ever holds the whole
        model. The strategy materializes this rank's shards (and pipeline stage) during setup, each
        single-device block initialized by its own initializer just before it is sliced."""
        with torch.device("meta"):
            yield

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        def closure_then_finalize() -> Any:
            # The closure runs the window's last backward: buckets reduce during it, gradients are final before clipping.
            assert self.grad_sync is not None
            with self.grad_sync.final_backward(optimizer):
                return closure()

        return super().optimizer_step(optimizer, closure_then_finalize, model, **kwargs)

    @override
    def on_exception(self, exception: BaseException) -> None:
        failed = report_failed_collective(exception, self.global_rank, self._timeout, getattr(self, "_failure_watch", None))
        if failed and isinstance(self.launcher, SubprocessScriptLauncher) and self.local_rank == 0:
            # The ranks this process started would wait for it until their own timeout, or stay stopped.
            self.launcher.kill(signal.SIGKILL)

    @override
    def teardown(self) -> None:
        if self._checkpoint_writer is not None:
            self._checkpoint_writer.close()  # a checkpoint still being written is finished and published
        if getattr(self, "_failure_watch", None) is not None:
            self._failure_watch.stop()  # a later run in this process (another Trainer) makes its own
        self.cluster_environment.teardown()  # type: ignore[union-attr]
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="lightning_seqpar with its defaults: tp=1")
        for tp in (2, 4, 8):
            strategy_registry.register(f"{cls.strategy_name}_tp{tp}", cls, description=f"lightning_seqpar tp={tp}", tp=tp)

