"""``SeqParallelStrategy``: Megatron-style tensor + sequence parallelism for ordinary LightningModules."""

from __future__ import annotations

from functools import partial
from contextlib import contextmanager
from typing import Any, Callable, Generator, Mapping, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

import lightning_seqpar.lightning.process_group as process_group
from lightning_seqpar.layout import Layout
from lightning_seqpar.lightning._compat import optimizers_to_device, set_num_threads_if_needed
from lightning_seqpar.lightning.auto_layout import AutoLayout, check_world, choose_layout
from lightning_seqpar.lightning.checkpoint_io import AtomicCheckpointIO
from lightning_seqpar.lightning.checkpointer import Checkpointer
from lightning_seqpar.lightning.config import (
    CheckpointConfig, LaunchConfig, PrecisionConfig, RewriteConfig, check_together, config_of,
)
from lightning_seqpar.lightning.launcher import configure_launcher, stop_started_ranks
from lightning_seqpar.lightning.memory_callbacks import layout_of_run
from lightning_seqpar.lightning.parallelize import check_before_start, parallelize
from lightning_seqpar.lightning.pipelined_steps import PipelinedSteps, check_pipelined_module, refuse_predict
from lightning_seqpar.lightning.precision import ShardAwareClipping, low_precision_residual, shard_aware
from lightning_seqpar.lightning.preemption import add_preemption
from lightning_seqpar.lightning.process_group import report_failed_collective, start_process_group
from lightning_seqpar.lightning.strategy_arguments import layout_of, refuse_moved
from lightning_seqpar.optim.grad_sync import GradientSync
from lightning_seqpar.parallel import ParallelMesh, RNGTracker
from lightning_seqpar.parallel.one_rank import decided_by_one_rank
from lightning_seqpar.rewriting import RewritePlan


class SeqParallelStrategy(ParallelStrategy):
    """Tensor (+ sequence), context, expert and pipeline parallel training of an ordinary LightningModule.

    ``setup_environment``: the process groups (:class:`~lightning_seqpar.parallel.ParallelMesh`). ``setup``:
    rank 0's weights on every rank → the recognized blocks rewritten (:func:`lightning_seqpar.explain` shows which) →
    the layer stack split into pipeline stages → this rank's shards materialized (:mod:`.parallelize`) → precision →
    optimizers (sharded over data-parallel ranks with ``zero=1``). Each step runs the module's own steps, through the
    pipeline schedule when ``pp > 1`` (:mod:`.pipelined_steps`); gradients are finalized over the mesh
    (:mod:`lightning_seqpar.optim`) and clipped by the whole model's norm. Checkpoints: :mod:`.checkpointer`.

    Parts it holds (each owns its state; the Lightning hooks below call them): :attr:`checkpointer`
    (:class:`~.checkpointer.Checkpointer`), :attr:`pipeline` (:class:`~.pipelined_steps.PipelinedSteps`, ``pp > 1``),
    :attr:`grad_sync` (:class:`~lightning_seqpar.optim.grad_sync.GradientSync`, while fitting).

    Args:
        tp, pp, cp, ep: shorthands for the sizes of ``layout`` (t, p, c, e); the data-parallel size is
            ``world // (tp·cp·pp)``.
        layout: how the model is split and run (:class:`~lightning_seqpar.Layout`: pipeline schedule and micro-batches,
            sequence/loss parallel, context-parallel attention, expert dispatch, ZeRO, loss chunks, recomputation and
            offload), or :class:`~.auto_layout.AutoLayout`: the planner's best layout for the model, the world and the
            device memory, chosen before the process groups are built. A mapping of either's fields (a recipe's).
        checkpointing: :class:`~.config.CheckpointConfig` (format, async save, what loading accepts).
        precision_config: :class:`~.config.PrecisionConfig`: what the strategy adds to Lightning's ``precision=``.
        rewriting: :class:`~.config.RewriteConfig`: the user's own policies, the rewrite's self-check, compiled blocks.
        seed: base seed of the dropout streams; default: rank 0's ``torch.initial_seed()``.
        launch: :class:`~.config.LaunchConfig`: start method, collective timeout, process group backend.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: Lightning's.

    Raises:
        TypeError: a keyword that moved into ``layout`` or a settings object, naming where
            (:data:`~.strategy_arguments.MOVED`).
        ValueError: settings each value refuses, or that refuse each other (:func:`~.config.check_together`); a size
            given both as a shorthand and in ``layout``; a world not divisible by ``tp·cp·pp`` (when the Trainer is
            made); at setup, ``low_precision_residual`` without autocast, a model with nothing to rewrite or with
            shapes that do not split t ways, a layer count or batch that does not split into the stages or
            micro-batches asked.
    """

    strategy_name = "seq_parallel"

    def __init__(
        self, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
        layout: Union[Layout, AutoLayout, Mapping[str, Any], None] = None,
        checkpointing: Union[CheckpointConfig, Mapping[str, Any], None] = None,
        precision_config: Union[PrecisionConfig, Mapping[str, Any], None] = None,
        rewriting: Union[RewriteConfig, Mapping[str, Any], None] = None,
        seed: Optional[int] = None,
        launch: Union[LaunchConfig, Mapping[str, Any], None] = None,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        **moved: Any,
    ) -> None:
        refuse_moved(moved)
        self.layout, self.auto = layout_of(layout, tp, pp, cp, ep)
        self.rewriting = config_of(rewriting, RewriteConfig, "rewriting")
        self.launch = config_of(launch, LaunchConfig, "launch")
        self.precision_config = config_of(precision_config, PrecisionConfig, "precision_config")
        checkpoint_config = config_of(checkpointing, CheckpointConfig, "checkpointing")
        check_together(checkpoint_config, self.layout, self.rewriting.compile)
        reads = [partial(getattr, self, name) for name in ("lightning_module", "optimizers", "_parallelized")]  # pickle
        self.checkpointer = Checkpointer(checkpoint_config, *reads)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io or AtomicCheckpointIO(),
                         precision_plugin=precision_plugin)
        self.process_group_backend = self.launch.backend
        self.chosen_layout: Optional[Any] = None  # under AutoLayout: the planner's record of the layout it chose
        self._seed = seed
        self._layout_choice: Optional[Any] = None
        self._mesh: Optional[ParallelMesh] = None
        self.rng_tracker: Optional[RNGTracker] = None
        self.rewrite_plan: Optional[RewritePlan] = None
        self.pipeline: Optional[PipelinedSteps] = None
        self._parallelized: Optional[torch.nn.Module] = None
        self.grad_sync: Optional[GradientSync] = None  # the fit's data-parallel reduction (one owner)
        self.num_nodes = 1

    tp = property(lambda self: self.layout.tp, doc="t, the tensor-parallel size (``layout.tp``).")
    pp = property(lambda self: self.layout.pp, doc="p, the pipeline-parallel size (``layout.pp``).")
    cp = property(lambda self: self.layout.cp, doc="c, the context-parallel size (``layout.cp``).")

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
        check_world(self.auto, self.layout, self.num_nodes * self.num_processes)
        self._launcher = configure_launcher(self, self.cluster_environment, self.launch.start_method,
                                            check_before_start)

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
        timeout = self.launch.timeout
        self._failure_watch = start_process_group(self.cluster_environment, self.process_group_backend, timeout)
        self.choose_layout()  # layout=AutoLayout(...): from the model, world and device memory, before any allocation
        dims = self.layout.dims(self.world_size)  # validated once, before any collective but the choice's
        self._mesh = ParallelMesh.build(device_type=self.root_device.type, timeout=timeout, dims=dims)
        plugin = self.precision_plugin
        assert isinstance(plugin, ShardAwareClipping)
        plugin.mesh = self._mesh
        self.checkpointer.start(timeout, self._mesh, self.root_device, self.layout)

    def choose_layout(self, module: Any = None, trainer: Any = None) -> None:
        """The run's :attr:`layout`: under ``layout=AutoLayout(...)`` the planner's choice
        (:class:`.auto_layout.LayoutChoice`), made once (the launching process, given ``module`` and ``trainer``, or
        rank 0) and sent to every rank; then its recomputation and offload made to agree with the run's callbacks
        (:func:`.memory_callbacks.layout_of_run`)."""
        module = module if module is not None else self.lightning_module
        run = trainer if trainer is not None else getattr(module, "_trainer", None)
        if self.auto is not None:
            choose = partial(choose_layout, self.auto, module, run, self.layout, device=self.root_device,
                             world=self.num_nodes * self.num_processes, gpus_per_node=self.num_processes,
                             sharded_context=self.model_sharded_context, compiled=self.rewriting.compile is not None)
            # The launching process chooses before any rank starts; on the ranks, rank 0's choice is sent to every rank.
            self._layout_choice = (self._layout_choice or choose()) if trainer is not None else decided_by_one_rank(
                lambda: self._layout_choice or choose(), self.global_rank == 0, self.broadcast)
            self.layout, self.chosen_layout = self._layout_choice.layout, self._layout_choice.record
        if run is not None:
            self.layout = layout_of_run(self.layout, run, chosen=self.auto is not None)

    @override
    def setup(self, trainer: Any) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if self.model is not self._parallelized:  # fit() then validate() on one trainer: rewritten once
            parallel = parallelize(
                self.model, self.mesh, self.root_device, self.layout, seed=self._seed, broadcast=self.broadcast,
                rewriting=self.rewriting, source=self.checkpointer.initial_weights)
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
            self.grad_sync = GradientSync.for_fit(self.grad_sync, self.model, self.optimizers,
                                                  self.lr_scheduler_configs, self.mesh, self.layout,
                                                  self.pipeline is not None)
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
    def precision_plugin(self) -> Precision:  # shard-aware: clipping must see every shard and stage
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
        return self.pipeline.run_training_step(self.lightning_module, self.precision_plugin, self.grad_sync, args,
                                               kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            return super().validation_step(*args, **kwargs)
        return self.pipeline.run_evaluation_step(self.lightning_module, self.precision_plugin, "validation", args,
                                                 kwargs)

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
        watch = getattr(self, "_failure_watch", None)
        if report_failed_collective(exception, self.global_rank, self.launch.timeout, watch):
            stop_started_ranks(self.launcher, self.local_rank)

    @override
    def teardown(self) -> None:
        self.checkpointer.close()  # a checkpoint still being written is finished and published
        if getattr(self, "_failure_watch", None) is not None:
            self._failure_watch.stop()  # a later run in this process (another Trainer) makes its own
        self.cluster_environment.teardown()  # type: ignore[union-attr]
        # still on the meta device after a refused rewrite: its .cpu() would hide the error
        module = self.lightning_module
        if module is not None and any(p.is_meta for p in module.parameters()):
            self.connect(None)  # type: ignore[arg-type]  # nothing to move back
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="lightning_seqpar with its defaults: tp=1")
        for tp in (2, 4, 8):
            strategy_registry.register(f"{cls.strategy_name}_tp{tp}", cls, description=f"lightning_seqpar tp={tp}",
                                       tp=tp)

