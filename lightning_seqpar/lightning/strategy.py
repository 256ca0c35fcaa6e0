"""``SeqParallelStrategy``: Megatron-style tensor + sequence parallelism for ordinary LightningModules."""

from __future__ import annotations

import atexit
import logging
import signal
from datetime import timedelta
from contextlib import contextmanager
from typing import Any, Callable, Generator, Iterable, Literal, Optional, Sequence, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer
from typing_extensions import override

from lightning_seqpar.lightning._compat import (
    SubprocessScriptLauncher,
    init_dist_connection,
    optimizers_to_device,
    set_num_threads_if_needed,
    sync_ddp_if_available,
)
from lightning_seqpar.checkpoint.writer import ShardedCheckpointWriter, coordinator_pid
from lightning_seqpar.lightning.checkpoint_io import AtomicCheckpointIO
from lightning_seqpar.lightning.checkpoint_hooks import CheckpointingMixin
from lightning_seqpar.optim.distributed_optimizer import shard_optimizers
from lightning_seqpar.parallel.faults import failed_collective
from lightning_seqpar.optim.gradients import finalize_gradients
from lightning_seqpar.lightning.launcher import SeqParallelSpawnLauncher
from lightning_seqpar.parallel.mesh import ParallelMesh, validate_layout
from lightning_seqpar.lightning.pipelined_steps import PipelinedSteps, check_pipelined_module
from lightning_seqpar.pipeline_parallel import PipelineConfig
from lightning_seqpar.lightning.precision import ShardAwareClipping, shard_aware
from lightning_seqpar.rewrite import Policy, RewriteContext, RewritePlan, rewrite
from lightning_seqpar.parallel.random import RNGTracker
from lightning_seqpar.transformer.materialize import Materializer


log = logging.getLogger(__name__)


def _destroy_process_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:  # every rank is done with its peers before any tears its connections down (bounded: a peer may be gone)
        dist.barrier(async_op=True).wait(timeout=timedelta(seconds=30))
    except Exception:  # noqa: BLE001 - at exit, a missing peer is no reason to keep the process
        pass
    dist.destroy_process_group()


def _as_timedelta(timeout: Union[float, timedelta, None]) -> timedelta:
    """Seconds or a ``timedelta`` (``None``: torch's default) as a positive ``timedelta``.

    Raises:
        ValueError: a value that is not positive, or not a number or ``timedelta``.
    """
    if timeout is None:
        return default_pg_timeout
    given = timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = timedelta(seconds=timeout)
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be a positive number of seconds or a datetime.timedelta, got {given!r}.")
    return timeout


class SeqParallelStrategy(CheckpointingMixin, ParallelStrategy):
    """Tensor (+ sequence) and pipeline parallel training of an ordinary LightningModule.

    On setup the strategy builds a ``(pp, dp, tp)`` process mesh (tensor-parallel ranks fastest),
    makes every rank start from rank 0's weights, and rewrites the transformer blocks it recognizes
    (see :func:`lightning_seqpar.explain`) into tensor-parallel modules whose shards are sliced from the
    single-device weights. Each step it sums the gradients of sequence-parallel parameters over the
    tensor-parallel group and averages all gradients over the data-parallel group; gradient clipping
    uses the norm of the whole (unsharded) gradient. Checkpoints hold the unparallelized state dict.

    With ``pp > 1`` the rewritten layer stack is split into stages (:mod:`lightning_seqpar.pipeline_parallel`):
    each batch is cut into ``num_microbatches`` micro-batches and the module's own ``training_step`` runs
    on each of them through the schedule; modules outside the stack (embeddings, final norm, head) are
    kept on every stage, used by the first (before the stack) or the last (after it), and their
    gradients are summed over the pipeline group. Validation and test steps run forward-only. What runs
    on which stage, which hooks see what, and what is refused (manual optimization, a step that catches
    the stage boundary, ``predict_step``) is the contract in :mod:`lightning_seqpar.pipeline_parallel.lightning_step`
    and the README's "Pipeline parallelism".

    Args:
        tp: tensor-parallel size t (ranks sharing each layer).
        pp: pipeline-parallel size p (stages of the layer stack).
        num_microbatches: m, micro-batches per batch under pipeline parallelism (default ``pp``); the
            per-rank batch size must be divisible by it.
        schedule: ``"1F1B"`` (default; with ``virtual_stages > 1`` the interleaved 1F1B), ``"gpipe"`` or
            ``"interleaved_1F1B"``.
        virtual_stages: v, model chunks per pipeline rank for the interleaved schedule.
        pipeline_split: layers of each of the ``pp·virtual_stages`` stages, in model order (default: equal).
        sequence_parallel: shard LayerNorm/dropout/residual activations along the sequence
            (Korthikanti et al. 2022 §4.2.2). Ignored when ``tp == 1``.
        loss_parallel: compute the reference GPT's loss on vocabulary-sharded logits.
        policies: extra :class:`~lightning_seqpar.Policy` objects for the user's own block classes.
        seed: base seed of the dropout streams; default: rank 0's ``torch.initial_seed()``.
        start_method: ``"popen"`` (re-run the script per rank, like DDP), ``"spawn"`` or ``"fork"``.
        process_group_backend: default ``"nccl"`` on GPUs, ``"gloo"`` on CPUs.
        timeout: how long a collective may wait for a peer before the job fails (seconds or a
            ``timedelta``; default torch's 30 minutes). A stalled rank then ends the job with an error that
            names the collective that timed out, instead of hanging it.
        allow_non_finite_checkpoint: load checkpoints whose weights or optimizer state hold NaN/inf
            (refused by default: they are corrupt, or the run had diverged).
        checkpoint_format: ``"sharded"`` (default): a checkpoint is a directory written by every rank in
            parallel through ``torch.distributed.checkpoint``, each rank its own shards, and it resumes under
            any other layout (tp, pp, dp, sequence parallelism, ``zero``); see :mod:`lightning_seqpar.checkpoint`.
            ``"full"``: one file holding the single-device model and optimizer, gathered onto every rank
            (small models only; resumes under the same pipeline layout). Both formats load whatever the setting.
        async_save: with the sharded format, write checkpoints in a background thread while training goes on
            (``torch.distributed.checkpoint.async_save``; one save in flight, the state is first copied to host memory).
        zero: ``1`` shards the optimizer state over the data-parallel ranks (ZeRO stage 1, Megatron's distributed
            optimizer; :mod:`lightning_seqpar.distributed_optimizer`); ``0`` (default) replicates it.

    The data-parallel size is ``world_size // (tp · pp)``.

    Raises:
        ValueError: ``timeout`` not positive; an unknown ``checkpoint_format`` or ``zero``; ``zero=1`` or
            ``async_save`` with ``checkpoint_format="full"``; ``tp``/``pp`` not positive integers; world size not divisible by ``tp · pp``;
            a model with nothing to rewrite or with shapes that do not split t ways; under ``pp > 1``, an
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
        checkpoint_format: Literal["sharded", "full"] = "sharded",
        async_save: bool = False,
        zero: Literal[0, 1] = 0,
    ) -> None:
        validate_layout(tp * pp, tp, pp)
        if checkpoint_format not in ("sharded", "full"):
            raise ValueError(f"checkpoint_format must be 'sharded' or 'full', got {checkpoint_format!r}.")
        if zero not in (0, 1):
            raise ValueError(f"zero must be 0 (replicated optimizer state) or 1 (sharded over data-parallel ranks), "
                             f"got {zero!r}.")
        if checkpoint_format == "full" and (zero or async_save):
            raise ValueError(
                f"checkpoint_format='full' gathers the whole optimizer onto every rank and writes from rank 0; "
                f"{'zero=1' if zero else 'async_save=True'} needs checkpoint_format='sharded'."
            )
        self.pipeline_config = PipelineConfig.build(pp, num_microbatches, schedule, virtual_stages, pipeline_split)
        if start_method not in ("popen", "spawn", "fork"):
            raise ValueError(f"start_method must be 'popen', 'spawn' or 'fork', got {start_method!r}.")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io or AtomicCheckpointIO(),
            precision_plugin=precision_plugin,
        )
        self.tp = tp
        self.sequence_parallel, self.loss_parallel = sequence_parallel, loss_parallel
        self.policies = list(policies or ())
        self._seed = seed
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        self._timeout = _as_timedelta(timeout)
        self.allow_non_finite_checkpoint = allow_non_finite_checkpoint
        self.checkpoint_format, self.async_save, self.zero = checkpoint_format, async_save, zero
        self._checkpoint_writer: Optional[ShardedCheckpointWriter] = None
        self._mesh: Optional[ParallelMesh] = None
        self.rng_tracker: Optional[RNGTracker] = None
        self.rewrite_plan: Optional[RewritePlan] = None
        self.pipeline: Optional[PipelinedSteps] = None
        self._remote_keys: list[str] = []
        self._parallelized: Optional[torch.nn.Module] = None
        self.num_nodes = 1

    # ------------------------------------------------------------------ layout
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
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        """Processes on this node."""
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
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = shard_aware(None)
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        # Lightning picks the plugin from Trainer(precision=...); its clipping must see every shard.
        self._precision_plugin = shard_aware(precision_plugin) if precision_plugin is not None else None

    @property
    def process_group_backend(self) -> Optional[str]:
        """``gloo`` or ``nccl``."""
        return self._process_group_backend

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # shards exist only after the rewrite

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            return
        if self._start_method == "popen":
            self._launcher = SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = SeqParallelSpawnLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        # Lightning's Fabric launchers do this; the Trainer's do not. Without it every process runs
        # cpu_count intra-op threads, and on CPU 4 processes on 2 cores ran 4.4x slower than with one each.
        set_num_threads_if_needed(self.num_processes)
        self.set_world_ranks()
        validate_layout(self.world_size, self.tp, self.pp)  # before any collective
        if self._process_group_backend is None:
            self._process_group_backend = "nccl" if self.root_device.type == "cuda" else "gloo"
        assert self.cluster_environment is not None
        init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout)
        # Lightning does this for NCCL only. gloo's worker threads, left to interpreter teardown, abort a
        # finished process now and then ("terminate called without an active exception", rc 134).
        atexit.unregister(_destroy_process_group)  # once, however many trainers this process runs
        atexit.register(_destroy_process_group)
        self._mesh = ParallelMesh.build(self.tp, self.pp, self.root_device.type)
        plugin = self.precision_plugin
        assert isinstance(plugin, ShardAwareClipping)
        plugin.mesh = self._mesh
        # Background checkpoint writes run collectives of their own: never on training's process group.
        group = dist.new_group(backend="gloo") if self.async_save else None
        self._checkpoint_writer = ShardedCheckpointWriter(self.global_rank == 0, coordinator_pid(), group,
                                                          self.async_save)

    def set_world_ranks(self) -> None:
        """Tell the cluster environment this process's global rank and the world size."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ model
    @override
    def setup(self, trainer: Any) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if self.model is not self._parallelized:  # fit() then validate() on one trainer: rewritten once
            # The single-device model stays where it was built; only its shards move to the device below.
            self._broadcast_module(self.model)
            seed = self._seed if self._seed is not None else self.broadcast(torch.initial_seed() % 2**31)
            self.rng_tracker = self._seed_streams(seed)
            # Blocks built on the meta device (configure_model) become meta skeletons; after the stage split the
            # shards this rank keeps are allocated and filled from single-device submodules materialized one at a
            # time from a seed shared by every rank. Other stages' layers are never materialized.
            materializer = Materializer(seed)
            ctx = RewriteContext(self.mesh.tensor, self.sequence_parallel, self.rng_tracker, self.loss_parallel,
                                 materializer)
            self.rewrite_plan = rewrite(self.model, ctx, self.policies)
            if self.pipeline_config.enabled:
                self.pipeline, self._remote_keys = PipelinedSteps.build(
                    self.model, self.pipeline_config, self.mesh.pipeline, self.root_device
                )
            materializer.fill(self.model, self.mesh.tensor)
            self._parallelized = self.model
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            if self.pipeline is not None:
                check_pipelined_module(self.lightning_module)
            self.setup_optimizers(trainer)
            if self.zero:
                self.optimizers = shard_optimizers(self.optimizers, self.lr_scheduler_configs, self.mesh.data)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    def _broadcast_module(self, module: torch.nn.Module) -> None:
        """Give every rank rank 0's parameters and buffers, so an unseeded init cannot diverge.

        One tensor at a time, in place; with NCCL a host tensor goes through a device buffer of its size, so
        the unsliced model is never on the device.
        """
        if dist.get_world_size() == 1:
            return
        staged = dist.get_backend() == "nccl"
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                if tensor.is_meta:  # built in configure_model: materialized from a shared seed instead
                    continue
                if staged and tensor.device != self.root_device:
                    buffer = tensor.data.to(self.root_device)
                    dist.broadcast(buffer, src=0)
                    tensor.data.copy_(buffer)
                else:
                    dist.broadcast(tensor.data, src=0)

    def _seed_streams(self, seed: int) -> RNGTracker:
        pp_rank, tp_rank = self.mesh.pipeline.rank, self.mesh.tensor.rank
        # Replicated regions draw from the default generator: make it identical across the TP group.
        torch.manual_seed(seed + 100 * pp_rank)
        return RNGTracker.for_tensor_parallel(seed + 100 * pp_rank, tp_rank, self.root_device)

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
            result = closure()
            # Runs once per optimizer step (after the last accumulated backward), before clipping.
            finalize_gradients(self.lightning_module.parameters(), self.mesh)
            return result

        return super().optimizer_step(optimizer, closure_then_finalize, model, **kwargs)

    # ------------------------------------------------------------------ steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            return super().training_step(*args, **kwargs)
        assert self.lightning_module is not None
        with self.precision_plugin.train_step_context():
            return self.pipeline.training_step(self.lightning_module, *self._step_args(args, kwargs))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            return super().validation_step(*args, **kwargs)
        module = self.lightning_module
        with self.precision_plugin.val_step_context():
            return self.pipeline.evaluation_step(module, module.validation_step, *self._step_args(args, kwargs))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            return super().test_step(*args, **kwargs)
        module = self.lightning_module
        with self.precision_plugin.test_step_context():
            return self.pipeline.evaluation_step(module, module.test_step, *self._step_args(args, kwargs))

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is not None:
            raise NotImplementedError(
                "predict_step is not pipelined: its outputs would exist on the last stage only. Load the checkpoint "
                "(it holds the whole model) with pp=1 to predict."
            )
        return super().predict_step(*args, **kwargs)

    @staticmethod
    def _step_args(args: tuple, kwargs: dict) -> tuple[Any, int]:
        batch = args[0] if args else kwargs["batch"]
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        if len(args) > 2 or "dataloader_idx" in kwargs:
            raise NotImplementedError("Several dataloaders are not supported under pipeline parallelism.")
        return batch, batch_idx

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def on_exception(self, exception: BaseException) -> None:
        failure = failed_collective(exception)
        if failure is None:
            return
        if failure.timed_out:
            log.error(
                f"[rank {self.global_rank}] {failure.collective} timed out after {self._timeout.total_seconds():g} s "
                f"waiting for another rank: a peer is stalled (stopped, swapping, stuck in I/O) or far slower. The job "
                f"stops. If the peers are only slow, raise SeqParallelStrategy(timeout=...) (recipe: strategy.timeout=SECONDS)."
            )
        else:
            log.error(f"[rank {self.global_rank}] {failure.collective} failed: another rank is gone ({exception}).")
        if isinstance(self.launcher, SubprocessScriptLauncher) and self.local_rank == 0:
            # The ranks this process started would wait for it until their own timeout, or stay stopped.
            self.launcher.kill(signal.SIGKILL)

    @override
    def teardown(self) -> None:
        if self._checkpoint_writer is not None:
            self._checkpoint_writer.close()  # a checkpoint still being written is finished and published
        assert self.cluster_environment is not None
        self.cluster_environment.teardown()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="lightning_seqpar with its defaults: tp=1 (data parallel only)"
        )
        for tp in (2, 4, 8):
            strategy_registry.register(
                f"{cls.strategy_name}_tp{tp}", cls, description=f"lightning_seqpar, tensor + sequence parallel tp={tp}",
                tp=tp,
            )


def register() -> None:
    """Make ``Trainer(strategy="seq_parallel")`` (``tp=1``) and ``"seq_parallel_tp2"`` / ``_tp4`` / ``_tp8``
    resolve to :class:`SeqParallelStrategy`; other layouts: pass ``SeqParallelStrategy(tp=..., pp=...)``."""
    if SeqParallelStrategy.strategy_name not in StrategyRegistry:
        SeqParallelStrategy.register_strategies(StrategyRegistry)
