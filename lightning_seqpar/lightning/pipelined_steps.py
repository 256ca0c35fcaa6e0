"""A LightningModule's ``training_step`` / ``validation_step`` run through a pipeline schedule.

Lightning's automatic optimization calls ``training_step``, then ``zero_grad``, then ``backward`` on
the returned loss. A schedule runs forwards *and* backwards inside ``training_step``, so the
gradients it produces are set aside and handed back by the returned loss's backward
(:class:`_PipelinedLoss`); ``accumulate_grad_batches`` and loss scaling then act on them as on one device.

What the user logs inside the step is recorded on the last stage, averaged over micro-batches and
logged on every rank (with the user's ``self.log`` arguments), so ``sync_dist`` collectives line up.
While the schedule runs, ``module.log`` is an instance attribute that records the calls (Lightning
offers no public hook between ``self.log`` and its result collection); it is removed afterwards.

The contract with the user's LightningModule (docs/pipeline.md) is checked by
:func:`check_pipelined_module` before the first step.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
import torch.nn as nn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_seqpar.lightning.pipeline_logs import LogRecorder, LogShare
from lightning_seqpar.optim.grad_sync import GradientSync, ScheduleGradients
from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.pipeline_parallel.config import PipelineConfig
from lightning_seqpar.pipeline_parallel.executor import PipelineExecutor, StepResult, loss_of
from lightning_seqpar.pipeline_parallel.layout import StageLayout
from lightning_seqpar.pipeline_parallel.p2p import StageTransport, shapes_signature
from lightning_seqpar.pipeline_parallel.schedules import splits_backward
from lightning_seqpar.pipeline_parallel.stage import StageRuntime
from lightning_seqpar.tensor_parallel.split_backward import split_weight_gradients
from lightning_seqpar.tensor_parallel.weight_gradients import WeightGradientStore


def _batch_size(batch: Any) -> int:
    sizes: set[int] = set()
    apply_to_collection(batch, Tensor, lambda t: sizes.add(t.shape[0]) if t.dim() else None)
    if len(sizes) != 1:
        raise ValueError(
            f"Pipeline parallelism cuts the batch into micro-batches along dimension 0, which must be the same for "
            f"every tensor of the batch; found sizes {sorted(sizes) or 'none'}."
        )
    return sizes.pop()


def split_microbatches(batch: Any, num_microbatches: int) -> list[Any]:
    """Cut every tensor of ``batch`` (any nesting of lists, tuples, dicts) into m equal parts along dim 0.

    Raises:
        ValueError: tensors of different batch sizes, or a batch size not divisible by m.
    """
    b = _batch_size(batch)
    if b % num_microbatches:
        raise ValueError(
            f"A batch of {b} samples cannot be cut into num_microbatches={num_microbatches} equal micro-batches. "
            f"Use a batch size divisible by {num_microbatches} (and drop_last=True), or change num_microbatches."
        )
    return [apply_to_collection(batch, Tensor, lambda t, i=i: t.tensor_split(num_microbatches)[i])
            for i in range(num_microbatches)]


class _PipelinedLoss(torch.autograd.Function):
    """Identity on the loss value; its backward adds ``grad_output ×`` the set-aside gradients to ``.grad``."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, value: Tensor, grads: dict) -> Tensor:
        ctx.grads = grads
        return value.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[None, None, None]:
        for param, grad in ctx.grads.items():
            grad.mul_(grad_output.to(grad.dtype))  # in place, and no host read of grad_output (exact when it is 1)
            param.grad = grad if param.grad is None else param.grad + grad
        ctx.grads = {}
        return None, None, None


def check_pipelined_module(module: pl.LightningModule) -> None:
    """Refuse what cannot run through a pipeline schedule, on every rank, before the first step.

    Several optimizers need manual optimization in Lightning (it refuses them otherwise), so refusing
    manual optimization refuses them too.

    Raises:
        ValueError: manual optimization: its ``manual_backward``/``optimizer.step()`` inside
            ``training_step`` would run once per micro-batch, on the last stage only, while the schedule
            runs its own backward.
    """
    if not module.automatic_optimization:
        raise ValueError(
            f"{type(module).__name__} uses manual optimization (automatic_optimization=False). Under pipeline "
            f"parallelism the schedule runs the backward of every micro-batch inside training_step, so "
            f"manual_backward and optimizer.step() there cannot work. Use automatic optimization (one optimizer), "
            f"or pp=1."
        )


class PipelinedSteps:
    """Training and evaluation steps of a split LightningModule.

    Args:
        executor: runs the schedule on this rank (its config gives m; its transport, the pipeline group).
    """

    def __init__(self, executor: PipelineExecutor) -> None:
        self.executor = executor
        self.pipeline: ParallelGroup = executor.transport.group
        layout = executor.layout
        self.last_rank = layout.rank_of(layout.num_stages - 1)
        self.is_last = executor.rank == self.last_rank
        self.logs = LogShare(self.pipeline, self.last_rank)

    @classmethod
    def of(cls, runtime: StageRuntime, config: PipelineConfig, pipeline: ParallelGroup, device: Any,
           model: Optional[nn.Module] = None) -> "PipelinedSteps":
        """The steps of a model split into stages (:func:`lightning_seqpar.build.build_rank`).

        Args:
            runtime: the stages this rank runs.
            config: the pipeline configuration.
            pipeline: this rank's pipeline-parallel group (its rank is this rank's stage).
            device: where received activations and gradients are placed.
            model: this rank's part of the model; under a split schedule (ZB-H1, ZB-V, DualPipeV) its column- and
                row-parallel linears split their backward into one store (:func:`~lightning_seqpar.tensor_parallel.
                split_backward.split_weight_gradients`).
        """
        store = None
        if splits_backward(config.schedule) and model is not None:
            store = WeightGradientStore()
            split_weight_gradients(model, store)
        one_shape = runtime.layout.placement == "V"  # headers on the first boundaries only (comm_plan.carries_header)
        transport = StageTransport(pipeline, device, 1 + runtime.payload.parts, one_shape)
        return cls(PipelineExecutor(runtime, transport, config, store))

    @property
    def config(self) -> PipelineConfig:
        """The pipeline configuration."""
        return self.executor.config

    @property
    def layout(self) -> StageLayout:
        """The stage layout of the split model."""
        return self.executor.layout

    def _run(self, module: pl.LightningModule, step: Callable[..., Any], batch: Any, batch_idx: int,
             forward_only: bool, before_last_backward: Optional[Callable[[int, bool], Any]] = None
             ) -> tuple[StepResult, LogRecorder]:
        micro = split_microbatches(batch, self.config.num_microbatches)
        signature = shapes_signature(micro[0], forward_only)  # before the reference joins: the same on every stage
        micro = self._with_reference(module, micro, batch_idx)
        recorder = LogRecorder()
        module.log = recorder  # an instance attribute shadows LightningModule.log for the schedule only
        try:
            result = self.executor.run(lambda i: step(micro[i], batch_idx), forward_only=forward_only,
                                       signature=signature, before_last_backward=before_last_backward)
        finally:
            del module.log
        return result, recorder

    def _with_reference(self, module: pl.LightningModule, micro: list[Any], batch_idx: int) -> list[Any]:
        """The micro-batches with what ``module.reference_step`` returned for each merged in (on the last stage: the
        only one that computes it), after a forward-only schedule of it without gradients; unchanged when the module
        has no ``reference_step`` (or it is ``None``). A step needing a second forward of the same micro-batch (DPO's
        reference, the LoRA base with its adapters off) cannot make it inside its own step: each micro-batch runs
        one forward through the stages.

        Raises:
            RuntimeError: ``reference_step`` calls ``self.log`` (raised in the step, as any error of the user's step).
            TypeError: a micro-batch or what ``reference_step`` returned (raised in the step) is not a dict.
        """
        reference = getattr(module, "reference_step", None)
        if reference is None:
            return micro
        if not isinstance(micro[0], dict):
            raise TypeError(f"{type(module).__name__}.reference_step under pipeline parallelism merges what it returns "
                            f"into the micro-batch, which must be a dict; got a {type(micro[0]).__name__}.")

        def step(i: int) -> dict:
            extra = reference(micro[i], batch_idx)
            if not isinstance(extra, dict):  # only the last stage returns: raised there, as any error of the step
                raise TypeError(f"{type(module).__name__}.reference_step returned a {type(extra).__name__}: under "
                                f"pipeline parallelism it returns a dict, merged into the micro-batch.")
            return extra

        module.log = _refuse_reference_log(module)
        try:
            with torch.no_grad():
                result = self.executor.run(step, forward_only=True, signature=shapes_signature(micro[0], True))
        finally:
            del module.log
        if not self.is_last:
            return micro
        return [{**batch, **result.outputs[i]} for i, batch in enumerate(micro)]

    @staticmethod
    def _replay(module: pl.LightningModule, logged: list[tuple[str, Tensor, dict]], dtypes: dict) -> None:
        for name, value, kwargs in logged:
            module.log(name, value.to(dtypes.get(name) or torch.get_default_dtype()), **kwargs)

    def run_training_step(self, module: pl.LightningModule, precision: Any, grad_sync: Optional[GradientSync],
                          args: tuple, kwargs: dict) -> Tensor:
        """The strategy's ``training_step`` under pipeline parallelism: :meth:`training_step` on Lightning's call, in
        the precision plugin's context, with the gradients ``grad_sync`` schedules (none before the optimizers
        exist)."""
        batch, batch_idx = step_args(args, kwargs)
        gradients = None
        if grad_sync is not None:
            params = [p for p in module.parameters() if p.requires_grad]
            scaled = getattr(precision, "scaler", None) is not None  # its factor lives on the device
            gradients = grad_sync.schedule(params, batch_idx, module.trainer.accumulate_grad_batches, scaled)
        with precision.train_step_context():
            return self.training_step(module, batch, batch_idx, gradients)

    def run_evaluation_step(self, module: pl.LightningModule, precision: Any, stage: str, args: tuple,
                            kwargs: dict) -> None:
        """The strategy's ``validation_step`` / ``test_step`` (``stage``) under pipeline parallelism."""
        context = precision.val_step_context() if stage == "validation" else precision.test_step_context()
        with context:
            return self.evaluation_step(module, getattr(module, f"{stage}_step"), *step_args(args, kwargs))

    def training_step(self, module: pl.LightningModule, batch: Any, batch_idx: int,
                      gradients: Optional[ScheduleGradients] = None) -> Tensor:
        """Run ``module.training_step`` on every micro-batch through the schedule.

        ``gradients`` (from :meth:`~lightning_seqpar.optim.grad_sync.GradientSync.schedule`; default: none reduce):
        the window's earlier gradients are kept aside, and in the window's last batch the data-parallel buckets take
        each gradient during the last backward of its model chunk (the layer stack's parameters) or of this rank
        (the others), so their reductions start while backward goes on.

        Returns:
            The mean micro-batch loss, identical on every rank; its ``backward()`` puts the schedule's
            gradients (scaled by the incoming gradient, e.g. ``1/accumulate_grad_batches``) into ``.grad``
            (those the buckets took are theirs already). Nothing is read back to the host.
        """
        if gradients is None:
            gradients = ScheduleGradients([p for p in module.parameters() if p.requires_grad], None, 1.0, False)
        arm = None
        if gradients.reduces:
            executor = self.executor

            def arm(chunk: int, final: bool, deferred: Optional[bool]) -> None:
                # A chunk's layers are final after its last backward; the rest (embedding, head) after the rank's last.
                stage = self.layout.stage(executor.rank, chunk)
                params = None if final else executor.runtime.stage_parameters.get(stage, [])
                if deferred is not None:  # split backward: W's parameters at the last W, the others' at the last B
                    split = executor.weight_gradients.deferred  # type: ignore[union-attr]
                    params = [p for p in (gradients.params if params is None else params)
                              if (id(p) in split) == deferred]
                gradients.arm(params)
        result, recorder = self._run(module, module.training_step, batch, batch_idx, False, arm)
        fresh = gradients.fresh()
        mean = None
        if self.is_last:
            losses = [loss_of(result.outputs[i]).detach() for i in sorted(result.outputs)]
            mean = torch.stack(losses).mean()
        value, logged = self.logs.share("training", mean, recorder if self.is_last else None, module.device)
        self._replay(module, logged, self.logs.dtypes("training"))
        anchor = torch.zeros((), device=module.device, requires_grad=True)
        return _PipelinedLoss.apply(anchor, value.to(self.logs.loss_dtype("training")), fresh)

    def evaluation_step(self, module: pl.LightningModule, step: Callable[..., Any], batch: Any, batch_idx: int) -> None:
        """Forward-only pipeline of ``step`` (``validation_step`` / ``test_step``); returns ``None``. What it logs is
        learnt anew from each loop's first step (``batch_idx`` 0, the same on every rank): loops may log differently
        (a DPO reference pass logs nothing)."""
        if batch_idx == 0:
            self.logs.forget("evaluation")
        _, recorder = self._run(module, step, batch, batch_idx, forward_only=True)
        _, logged = self.logs.share("evaluation", None, recorder if self.is_last else None, module.device)
        self._replay(module, logged, self.logs.dtypes("evaluation"))


def _refuse_reference_log(module: pl.LightningModule) -> Callable[..., None]:
    def log(name: str, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{type(module).__name__}.reference_step logged {name!r}: under pipeline parallelism it "
                           f"runs in a schedule of its own before training_step's. Log in training_step.")
    return log


def step_args(args: tuple, kwargs: dict) -> tuple[Any, int]:
    """``(batch, batch_idx)`` of a step's call as Lightning makes it.

    Raises:
        NotImplementedError: several dataloaders (``dataloader_idx``).
    """
    batch = args[0] if args else kwargs["batch"]
    batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
    if len(args) > 2 or "dataloader_idx" in kwargs:
        raise NotImplementedError("Several dataloaders are not supported under pipeline parallelism.")
    return batch, batch_idx


def refuse_predict() -> None:
    """``predict_step`` under pipeline parallelism.

    Raises:
        NotImplementedError: always, naming the fix.
    """
    raise NotImplementedError(
        "predict_step is not pipelined: its outputs would exist on the last stage only. Load the checkpoint "
        "(it holds the whole model) with pp=1 to predict."
    )
