"""``SeqParallelStrategy``: Megatron-style tensor + sequence parallelism for ordinary LightningModules."""

from __future__ import annotations

from functools import partial
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Generator, Iterable, Literal, Mapping, Optional, Sequence, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

import lightning_seqpar.lightning.process_group as process_group
from lightning_seqpar.lightning._compat import optimizers_to_device, set_num_threads_if_needed
from lightning_seqpar.lightning.auto_layout import AutoLayout, auto_layout_of, check_world, choose_layout
from lightning_seqpar.lightning.checkpoint_io import AtomicCheckpointIO
from lightning_seqpar.lightning.checkpointer import Checkpointer
from lightning_seqpar.lightning.config import (
    CheckpointConfig, DataParallelConfig, DispatchConfig, ParallelConfig, PrecisionConfig, check_together,
    parallel_config_of,
)
from lightning_seqpar.lightning.launcher import check_start_method, configure_launcher, stop_started_ranks
from lightning_seqpar.lightning.parallelize import check_before_start, parallelize
from lightning_seqpar.lightning.pipelined_steps import PipelinedSteps, check_pipelined_module, refuse_predict
from lightning_seqpar.lightning.precision import ShardAwareClipping, low_precision_residual, shard_aware
from lightning_seqpar.lightning.preemption import add_preemption
from lightning_seqpar.lightning.process_group import as_timedelta, report_failed_collective, start_process_group
from lightning_seqpar.optim.grad_sync import GradientSync
from lightning_seqpar.parallel import ParallelMesh, RNGTracker
from lightning_seqpar.parallel.one_rank import decided_by_one_rank
from lightning_seqpar.pipeline_parallel import PipelineConfig
from lightning_seqpar.rewriting import Policy, RewritePlan
from lightning_seqpar.transformer.compiling import CompileConfig, compile_config_of


class SeqParallelStrategy(ParallelStrategy):
    """Tensor (+ sequence) and pipeline parallel training of an ordinary LightningModule.

    ``setup_environment``: the process groups (:class:`~lightning_seqpar.parallel.ParallelMesh`). ``setup``:
    rank 0's weights on every rank → the recognized blocks rewritten (:func:`lightning_seqpar.explain` shows which) →
    the layer stack split into pipeline stages → this rank's shards materialized (:mod:`.parallelize`) → precision →
    optimizers (sharded over data-parallel ranks with ``zero=1``). Each step runs the module's own steps, through the
    pipeline schedule when ``pp > 1`` (:mod:`.pipelined_steps`); gradients are finalized over the mesh
    (:mod:`lightning_seqpar.optim`) and clipped by the whole model's norm. Checkpoints: :mod:`.checkpointer`.

    Parts it holds (each owns its state; the Lightning hooks below call them): :attr:`checkpointer`
    (:class:`~.checkpointer.Checkpointer`), :attr:`pipeline` (:class:`~.pipelined_steps.PipelinedSteps`, ``pp > 1``),
    :attr:`grad_sync` (:class:`~lightning_seqpar.optim.grad_sync.GradientSync`, while fitting). Settings by part
    (:mod:`.config`): ``parallel``, ``checkpointing``, ``data_parallel``, ``precision_config``; the flat keywords
    are shorthands for their fields.

    Args:
        tp, pp, cp, ep, expert_tp, moe, cp_comm, loss_chunk, sequence_parallel, loss_parallel: shorthands for the
            fields of ``parallel`` (:class:`~.config.ParallelConfig`: t, p, c, e, etp, the experts' :class:`~.
            DispatchConfig` or its mapping, the others documented there). Data-parallel size: ``world // (tp·cp·pp)``.
        num_microbatches, schedule, virtual_stages, pipeline_split: shorthands for its ``pipeline``
            (:class:`~lightning_seqpar.pipeline_parallel.PipelineConfig`: m, default ``pp``, DualPipeV ``2·pp``; a
            schedule of :data:`~lightning_seqpar.pipeline_parallel.SCHEDULES`; v; the layers of each stage).
        policies: extra :class:`~lightning_seqpar.Policy` objects for the user's own block classes.
        verify_rewrite: check the rewrite before training, without communication: a Hugging Face causal LM whole (a
            small copy on emulated tp ranks), other declared blocks once per class and configuration.
        seed: base seed of the dropout streams; default: rank 0's ``torch.initial_seed()``.
        start_method: ``"popen"`` (re-run the script per rank, like DDP), ``"spawn"`` or ``"fork"``.
        process_group_backend: default ``"nccl"`` on GPUs, ``"gloo"`` on CPUs.
        timeout: how long a collective may wait for a peer before the job fails (seconds or a ``timedelta``; default
            torch's 30 minutes). A stalled rank then ends the job with an error naming the collective, not a hang.
        allow_non_finite_checkpoint, allow_unverified_checkpoint, checkpoint_format, async_save, zero, fp32_main_params,
            low_precision_residual: shorthands for fields of the groups ``checkpointing``, ``data_parallel`` and
            ``precision_config`` (:mod:`.config`'s classes), which may be given instead.
        layout: :class:`~.auto_layout.AutoLayout` (then no ``tp``/``pp``): the planner's best layout for the model,
            the world and the device memory, chosen before the process groups are built (:mod:`.auto_layout`).
        parallel: :class:`~.config.ParallelConfig`, instead of its shorthands above.
        compile: blocks through ``torch.compile(fullgraph=True)``: ``True`` or a :class:`~lightning_seqpar.CompileConfig`.

    Raises:
        ValueError: settings each config refuses, or that refuse each other (:func:`~.config.check_together`);
            ``timeout`` not positive; ``tp``/``pp``/``cp`` not positive integers; a world not divisible by ``tp·cp·pp``;
            at setup, ``low_precision_residual`` without autocast, a model with nothing to rewrite or with shapes that
            do not split t ways, a layer count or batch that does not split into the stages or micro-batches asked.
    """

    strategy_name = "seq_parallel"

    def __init__(
        self,
        tp: int = 1, pp: int = 1,
        num_microbatches: Optional[int] = None,
        schedule: str = "1F1B", virtual_stages: int = 1,
        pipeline_split: Optional[Sequence[int]] = None,
        sequence_parallel: bool = True, loss_parallel: bool = True,
        policies: Optional[Iterable[Policy]] = None,
        verify_rewrite: bool = True, compile: Union[bool, CompileConfig, Mapping[str, Any], None] = False,
        seed: Optional[int] = None,
        start_method: Literal["popen", "spawn", "fork"] = "popen",
        accelerator: Optional[Accelerator] = None, parallel_devices: Optional[list[torch.device]] = None,
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
        checkpointing: Optional[CheckpointConfig] = None,
        data_parallel: Optional[DataParallelConfig] = None,
        precision_config: Optional[PrecisionConfig] = None,
        layout: Optional[AutoLayout] = None,
        cp: int = 1, cp_comm: Literal["ring", "all_to_all"] = "ring", loss_chunk: Optional[int] = 4096, ep: int = 1,
        expert_tp: int = 1, moe: Union[DispatchConfig, dict, None] = None, parallel: Optional[ParallelConfig] = None,
    ) -> None:
        self.auto, self.chosen_layout, self._layout_choice = auto_layout_of(layout, tp, pp, cp), None, None
        self.parallel = parallel_config_of(parallel, tp=1 if tp == "auto" else tp, cp=cp, cp_comm=cp_comm, ep=ep, moe=moe,
                                           expert_tp=expert_tp, sequence_parallel=sequence_parallel,
                                           loss_parallel=loss_parallel, loss_chunk=loss_chunk, pipeline=PipelineConfig.build(
                                               pp, num_microbatches, schedule, virtual_stages, pipeline_split))
        reads = [partial(getattr, self, name) for name in ("lightning_module", "optimizers", "_parallelized")]  # pickle
        self.checkpointer = Checkpointer(checkpointing or CheckpointConfig(
            checkpoint_format, async_save, allow_non_finite_checkpoint, allow_unverified_checkpoint), *reads)
        self.data_parallel = data_parallel or DataParallelConfig(zero, fp32_main_params)
        check_together(self.checkpointer.config, self.data_parallel, self.parallel, compile_config_of(compile))
        check_start_method(start_method)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
                         checkpoint_io=checkpoint_io or AtomicCheckpointIO(), precision_plugin=precision_plugin)
        self.policies, self.verify_rewrite, self.compile_config = list(policies or ()), verify_rewrite, compile_config_of(compile)
        self._seed, self._start_method, self.process_group_backend = seed, start_method, process_group_backend
        self._timeout, self.precision_config = as_timedelta(timeout), precision_config or PrecisionConfig(low_precision_residual)
        self._mesh: Optional[ParallelMesh] = None
        self.rng_tracker: Optional[RNGTracker] = None
        self.rewrite_plan: Optional[RewritePlan] = None
        self.pipeline: Optional[PipelinedSteps] = None
        self._parallelized: Optional[torch.nn.Module] = None
        self.grad_sync: Optional[GradientSync] = None  # the fit's data-parallel reduction (one owner)
        self.num_nodes = 1

    tp = property(lambda self: self.parallel.tp, doc="t, the tensor-parallel size (``parallel.tp``).")
    pp = property(lambda self: self.parallel.pp, doc="p, the pipeline-parallel size (``parallel.pp``).")
    cp = property(lambda self: self.parallel.cp, doc="c, the context-parallel size (``parallel.cp``).")

    @property
    def mesh(self) -> ParallelMesh:
        """This rank's process groups, by name (:class:`~lightning_seqpar.parallel.ParallelMesh`)."""
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
        return {"num_replicas": self.mesh.dp, "rank": self.mesh.batch_rank}  # cp peers too

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # shards exist only after the rewrite

    @override
    def _configure_launcher(self) -> None:  # in Trainer(): a world that does not split fails there, before any rank
        check_world(self.auto, self.parallel, self.num_nodes * self.num_processes)
        self._launcher = configure_launcher(self, self.cluster_environment, self._start_method, check_before_start)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        # Lightning's Fabric launchers do this; the Trainer's do not. Without it every process runs
        # cpu_count intra-op threads, and on CPU 4 processes on 2 cores ran 4.4x slower than with one each.
        set_num_threads_if_needed(self.num_processes)
        process_group.set_world_ranks(self.cluster_environment, self.node_rank * self.num_processes + self.local_rank,
                                      self.num_nodes * self.num_processes)
        if self.process_group_backend is None:
            self.process_group_backend = "nccl" if self.root_device.type == "cuda" else "gloo"
        assert self.cluster_environment is not None
        self._failure_watch = start_process_group(self.cluster_environment, self.process_group_backend, self._timeout)
        self.choose_layout()  # layout=AutoLayout(...): from the model, world and device memory, before any allocation
        dims = self.parallel.dims(self.world_size)  # validated once, before any collective but the choice's
        self._mesh = ParallelMesh.build(device_type=self.root_device.type, timeout=self._timeout, dims=dims)
        plugin = self.precision_plugin
        assert isinstance(plugin, ShardAwareClipping)
        plugin.mesh = self._mesh
        self.checkpointer.start(self._timeout, self._mesh, self.root_device, self.data_parallel, self.parallel)

    def choose_layout(self, module: Any = None, trainer: Any = None) -> None:
        """``layout=AutoLayout(...)``: the planner's :class:`.auto_layout.LayoutChoice` becomes ``parallel``; made once
        (the launching process, given ``module`` and ``trainer``, or rank 0) and sent to every rank."""
        if self.auto is None:
            return
        module = module if module is not None else self.lightning_module
        choose = partial(choose_layout, self.auto, module, trainer or module.trainer, self.parallel, device=self.root_device,
                         world=self.num_nodes * self.num_processes, gpus_per_node=self.num_processes, zero=self.data_parallel.zero,
                         sharded_context=self.model_sharded_context, compiled=self.compile_config is not None)
        # The launching process chooses before any rank starts; on the ranks, rank 0's choice is sent to every rank.
        self._layout_choice = (self._layout_choice or choose()) if trainer is not None else decided_by_one_rank(
            lambda: self._layout_choice or choose(), self.global_rank == 0, self.broadcast)
        self.parallel, self.chosen_layout = self._layout_choice.parallel, self._layout_choice.record
        self._layout_choice.add_callbacks(trainer or module.trainer)

    @override
    def setup(self, trainer: Any) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if self.model is not self._parallelized:  # fit() then validate() on one trainer: rewritten once
            parallel = parallelize(
                self.model, self.mesh, self.root_device, self.parallel, seed=self._seed, broadcast=self.broadcast,
                policies=self.policies, verify=self.verify_rewrite, source=self.checkpointer.initial_weights,
                compiled=self.compile_config)
            self.checkpointer.initial_weights = None
            if self.precision_config.low_precision_residual:
                low_precision_residual(self.model, self.precision_plugin)
            self.rng_tracker, self.rewrite_plan = parallel.rng_tracker, parallel.rewrite_plan
            self.pipeline, self.checkpointer.remote_keys = parallel.pipeline, parallel.remote_keys
            self._parallelized = self.model
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            add_preemption(trainer)  # SIGTERM: a checkpoint at a step every rank agrees on (no collective in a handler)
            if self.pipeline is not None:
                check_pipelined_module(self.lightning_module)
            self.setup_optimizers(trainer)
            self.grad_sync = GradientSync.for_fit(self.grad_sync, self.model, self.optimizers, self.lr_scheduler_configs,
                                                  self.mesh, self.data_parallel, self.pipeline is not None)
            self.optimizers = self.grad_sync.optimizers
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model()`` runs on the meta device: no rank holds the whole model; setup materializes this
        rank's shards (and stage), each single-device block initialized by its own initializer, then sliced."""
        with torch.device("meta"):
            yield

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        assert self.grad_sync is not None
        return super().optimizer_step(optimizer, self.grad_sync.finalizing(optimizer, closure), model, **kwargs)

    # ---- Lightning's hooks, each handed to the part that owns it
    @property
    @override
    def precision_plugin(self) -> Precision:  # kept as its shard_aware subclass: clipping must see every shard and stage
        self._precision_plugin = self._precision_plugin or shard_aware(None)
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        self._precision_plugin = shard_aware(precision_plugin) if precision_plugin is not None else None

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            return super().training_step(*args, **kwargs)
        return self.pipeline.run_training_step(self.lightning_module, self.precision_plugin, self.grad_sync, args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            return super().validation_step(*args, **kwargs)
        return self.pipeline.run_evaluation_step(self.lightning_module, self.precision_plugin, "validation", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            return super().test_step(*args, **kwargs)
        return self.pipeline.run_evaluation_step(self.lightning_module, self.precision_plugin, "test", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is not None:
            refuse_predict()
        return super().predict_step(*args, **kwargs)

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        process_group.barrier(self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return process_group.broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        return process_group.reduce(tensor, group, reduce_op)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.checkpointer.model_state()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self.checkpointer.optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        self.checkpointer.save(checkpoint, filepath, storage_options, super().save_checkpoint)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        self.checkpointer.wait()  # never remove a checkpoint still being published
        super().remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        return self.checkpointer.load(checkpoint_path, weights_only, super().load_checkpoint)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self.checkpointer.load_model_state_dict(checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self.checkpointer.load_optimizer_state_dict(checkpoint)

    def full_state_dict(self) -> dict[str, Any]:
        """:meth:`.checkpointer.Checkpointer.full_state_dict`: the single-device state dict (collective)."""
        return self.checkpointer.full_state_dict()

    def load_single_device_state_dict(self, source: Any, strict: bool = True, prefix: str = "") -> None:
        """:meth:`.checkpointer.Checkpointer.load_single_device_state_dict`: start from single-device weights."""
        self.checkpointer.load_single_device_state_dict(source, strict, prefix)

    def save_hf_pretrained(self, out: Any, config: Any = None, prefix: str = "model.", **options: Any) -> Any:
        """:meth:`.checkpointer.Checkpointer.save_hf_pretrained`: export a Hugging Face directory (collective)."""
        return self.checkpointer.save_hf_pretrained(out, config, prefix, **options)

    @override
    def on_exception(self, exception: BaseException) -> None:
        if report_failed_collective(exception, self.global_rank, self._timeout, getattr(self, "_failure_watch", None)):
            stop_started_ranks(self.launcher, self.local_rank)

    @override
    def teardown(self) -> None:
        self.checkpointer.close()  # a checkpoint still being written is finished and published
        if getattr(self, "_failure_watch", None) is not None:
            self._failure_watch.stop()  # a later run in this process (another Trainer) makes its own
        self.cluster_environment.teardown()  # type: ignore[union-attr]
        module = self.lightning_module  # still on the meta device after a refused rewrite: its .cpu() would hide the error
        if module is not None and any(p.is_meta for p in module.parameters()):
            self.connect(None)  # type: ignore[arg-type]  # nothing to move back
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="lightning_seqpar with its defaults: tp=1")
        for tp in (2, 4, 8):
            strategy_registry.register(f"{cls.strategy_name}_tp{tp}", cls, description=f"lightning_seqpar tp={tp}", tp=tp)

