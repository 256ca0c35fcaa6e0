"""How :class:`~lightning_seqpar.SeqParallelStrategy` saves and loads checkpoints: its :class:`Checkpointer` part.

Two formats (``CheckpointConfig.format``): ``"sharded"``, a directory written by every rank through
``torch.distributed.checkpoint`` that any layout loads (:mod:`lightning_seqpar.checkpoint`), and ``"full"``,
one file holding the single-device model and optimizer, gathered onto every rank and written by rank 0.
Both load whatever the setting. Also here: single-device weights (a state dict, ``.pt``, ``.safetensors``,
a Hugging Face directory) as the starting point of any layout, and the Hugging Face export.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor
from torch.optim import Optimizer

from lightning_seqpar.checkpoint.checks import (
    check_finite,
    check_initial_weights,
    check_stage_placement,
    check_state_dict_shapes,
    on_every_rank,
    optimizer_states_of_this_stage,
)
from lightning_seqpar.checkpoint.consolidate import load_state_dict_file
from lightning_seqpar.checkpoint.hf_export import export_hf_pretrained
from lightning_seqpar.checkpoint.manifest import check_zip_file, is_zip_file
from lightning_seqpar.checkpoint.locate import not_a_checkpoint
from lightning_seqpar.checkpoint.full_state import (
    full_optimizer_state,
    full_state_dict,
    load_full_optimizer_state,
    load_full_state_dict,
)
from lightning_seqpar.checkpoint.stages import merge_over_stages
from lightning_seqpar.checkpoint.sharded import (
    FORMAT_KEY,
    is_sharded_checkpoint,
    model_entries,
    single_device_shapes,
    tied_aliases,
)
from lightning_seqpar.checkpoint.trainer_checkpoint import (
    load_trainer_checkpoint,
    optimizer_checkpoint_state,
    save_trainer_checkpoint,
)
from lightning_seqpar.checkpoint.writer import ShardedCheckpointWriter, coordinator_pid
from lightning_seqpar.hf.checkpoint_keys import checkpoint_key_renamer
from lightning_seqpar.hf.weights import SafetensorsStateDict
from lightning_seqpar.transformer.materialize import has_meta_tensors
import lightning_seqpar.lightning.process_group as process_group
from lightning_seqpar.lightning.checkpoint_io import remove_stale_temporaries
from lightning_seqpar.lightning.config import CheckpointConfig
from lightning_seqpar.checkpoint.frozen_base import FrozenBase
from lightning_seqpar.checkpoint.peft_export import MergedLoRA, adapter_state_dict
from lightning_seqpar.transformer.lora import adapter_keys
from lightning_seqpar.pipeline_parallel.schedules import stage_placement_of


FULL_FORMAT_MARK = "lightning_seqpar_full_format"
"""Key of a full-format checkpoint written by the strategy (its optimizer state is in the parallel model's order): its
value records which layers each pipeline rank held (``{"stages": ...}``; ``True`` before the record)."""


class Checkpointer:
    """The strategy's checkpoint part: it owns the writer, the checkpoint settings, the keys other pipeline stages
    hold and the single-device weights waiting for the shards. It is given what it reads and does not own: the
    module and the optimizers (accessors: Lightning sets them later), and at :meth:`start` the mesh, the device and the
    layout settings a checkpoint records; its collectives are the process group's. The strategy's Lightning hooks call
    it.

    Args:
        config: the checkpoint settings.
        module: the LightningModule being trained (an accessor).
        optimizers: the optimizers being stepped (an accessor).
        rewritten: the module the strategy rewrote, whose shards exist (an accessor).
    """

    def __init__(self, config: CheckpointConfig, module: Callable[[], Any], optimizers: Callable[[], Sequence[Any]],
                 rewritten: Callable[[], Any]) -> None:
        self.config, self._module, self._optimizers, self._rewritten = config, module, optimizers, rewritten
        self._mesh: Optional[Any] = None
        self._device: Optional[torch.device] = None
        self._settings: dict[str, Any] = {}
        self._stages: dict[str, Any] = {}  # the pipeline's placement of layers on ranks (a full checkpoint records it)
        self.writer: Optional[ShardedCheckpointWriter] = None
        self.remote_keys: list[str] = []  # state-dict keys of other pipeline stages (set when the model is split)
        self.initial_weights: Optional[Mapping[str, Any]] = None  # read into the shards as they are made
        self.frozen_base: Optional[FrozenBase] = None  # where frozen weights were read from: not checkpointed again

    def start(self, timeout: Any, mesh: Any, device: torch.device, layout: Any) -> None:
        """Make the writer, once the process group exists; ``mesh`` and ``device`` are this rank's, ``layout`` the
        strategy's :class:`~lightning_seqpar.Layout` (a checkpoint records ``zero`` and ``sequence_parallel``)."""
        self._mesh, self._device = mesh, device
        self._settings = {"zero": layout.zero, "sequence_parallel": layout.sequence_parallel}
        pipeline = layout.pipeline  # which layers each rank holds: a full checkpoint's optimizer state follows it
        self._stages = {"virtual_stages": pipeline.virtual_stages, "placement": stage_placement_of(pipeline.schedule),
                        "split": list(pipeline.split) if pipeline.split is not None else None}
        # Background checkpoint writes run collectives of their own: never on training's process group.
        group = (dist.new_group(backend="gloo", timeout=timeout, group_desc="async_save") if self.config.async_save
                 else None)
        self.writer = ShardedCheckpointWriter(dist.get_rank() == 0, coordinator_pid(), group, self.config.async_save)

    def close(self) -> None:
        """Finish and publish a checkpoint still being written."""
        if self.writer is not None:
            self.writer.close()

    @property
    def module(self) -> Any:
        """The LightningModule being trained."""
        return self._module()

    @property
    def mesh(self) -> Any:
        """This rank's process groups.

        Raises:
            RuntimeError: before :meth:`start`.
        """
        if self._mesh is None:
            raise RuntimeError("The checkpointer was used before the strategy set up its process groups.")
        return self._mesh

    @property
    def _shard_meshes(self) -> Any:
        """Each parameter's device mesh of the group its shard is split over (DTensor views of shards)."""
        return self.mesh.shard_device_mesh

    def model_state(self) -> dict[str, Any]:
        """Sharded format: this rank's shards as ``torch.distributed.checkpoint`` views (same keys as the
        single-device model; no communication). Full format: the unparallelized model's state dict,
        gathered from the shards (collective, every rank)."""
        assert self.module is not None
        if self.config.format == "sharded":
            entries = model_entries(self.module, self._shard_meshes)
            frozen = self._frozen_record()
            return entries if frozen is None else {k: v for k, v in entries.items() if k not in set(frozen.keys)}
        return self.full_state_dict()

    def _frozen_record(self) -> Optional[FrozenBase]:
        """The frozen base this checkpoint leaves out: frozen parameters read from a pretrained directory."""
        if self.frozen_base is None or self.module is None:
            return None
        record = self.frozen_base.with_keys(self.module)
        if not self.frozen_base.digests and self._any_rank(bool(record.keys)):
            # hashed once per run, when the first checkpoint needs it, by every rank together (a pipeline stage may
            # hold no frozen weight and still takes its share of the files)
            self.frozen_base = self.frozen_base.with_digests()
        return replace(record, digests=self.frozen_base.digests) if record.keys else None

    @staticmethod
    def _any_rank(flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (collective when distributed)."""
        if not dist.is_available() or not dist.is_initialized():
            return flag
        flags: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(flags, flag)
        return any(flags)

    def full_state_dict(self) -> dict[str, Any]:
        """The single-device state dict of the trained model (same keys and shapes as before the rewrite),
        on every rank, e.g. after ``trainer.fit``. Collective: every rank must call it. ``module.state_dict()``
        returns this rank's shards instead."""
        assert self.module is not None
        return merge_over_stages(full_state_dict(self.module, self.mesh), self.mesh.pipeline)

    def load_single_device_state_dict(self, source: Union[str, Path, Mapping[str, Tensor]], strict: bool = True,
                                      prefix: str = "", adapter: Union[str, Path, None] = None) -> None:
        """Start from single-device weights in any layout: copy this rank's shards (and stage) out of ``source``:

        - a state dict of the unparallelized model;
        - a ``.pt``/``.ckpt`` file holding one (read with ``weights_only=True``, memory-mapped);
        - a ``.safetensors`` file or a Hugging Face checkpoint directory (``*.safetensors``, sharded index
          included): read lazily, each rank only the rows of its own shards;
        - a sharded checkpoint directory of ours.

        ``prefix`` is prepended to the file's keys: the attribute path of the stored model inside your
        LightningModule (``"model."`` for ``self.model = AutoModelForCausalLM...``). A tied parameter may be
        stored under one of its keys.

        Called in ``configure_model()`` on a model built there (on the meta device), the weights are read when the
        strategy materializes the shards: each tensor straight into its shard, with no random initialization first
        (keys the source lacks, with ``strict=False``, are drawn with the model's own initializer); no rank holds
        the whole model. Called after setup (e.g. in ``on_fit_start``), it copies into the existing shards
        (collective).

        ``adapter``: a PEFT adapter directory whose LoRA weights start the PEFT-wrapped model under ``prefix``
        (read lazily like the base, each rank its own slices); ``source`` is then the base model's directory.

        Raises:
            KeyError: with ``strict``, keys missing from ``source`` or unknown to the model.
            ValueError: a tensor of another shape, or non-finite values in an in-memory state dict (checked on
                every rank first).
        """
        if adapter is not None:
            base = Path(source)  # type: ignore[arg-type]
            stored = self._stored_model(prefix)
            source = {**SafetensorsStateDict(base, prefix, checkpoint_key_renamer(stored)),
                      **adapter_state_dict(Path(adapter), prefix, stored)}
            self.frozen_base = FrozenBase.of(base)
            prefix = ""
        if not isinstance(source, Mapping):
            path = Path(source)
            if path.suffix == ".safetensors" or (path.is_dir() and not is_sharded_checkpoint(path)):
                self.frozen_base = FrozenBase.of(path)
            if path.suffix == ".safetensors" or (path.is_dir() and not is_sharded_checkpoint(path)):
                source = SafetensorsStateDict(path, prefix, checkpoint_key_renamer(self._stored_model(prefix)))
                prefix = ""
            else:
                source = load_state_dict_file(path)
        if prefix:
            source = {prefix + k: v for k, v in source.items()}
        module = self.module
        if module is not None and module is not self._rewritten() and has_meta_tensors(module):
            check_initial_weights(module, source, strict, frozenset(adapter_keys(module)))  # the same on every rank
            self.initial_weights = source  # read into the shards by setup's materialization
            return
        self.load_model_state_dict({"state_dict": source}, strict=strict)

    def _stored_model(self, prefix: str) -> Optional[nn.Module]:
        """The model under ``prefix`` in the LightningModule (``None``: none there; the keys check names the prefix)."""
        try:
            return self.module.get_submodule(prefix.rstrip(".")) if self.module is not None else None
        except AttributeError:
            return None

    def save_hf_pretrained(self, out: Union[str, Path], config: Any = None, prefix: str = "model.", *,
                           source: Union[str, Path, None] = None, max_shard_size: Union[int, str] = "5GB",
                           dtype: Optional[torch.dtype] = None, tokenizer: Any = None,
                           overwrite: bool = False, merge_lora: bool = False) -> Path:
        """Export the trained Hugging Face model as a directory ``AutoModelForCausalLM.from_pretrained(out)`` loads,
        without a whole model on any rank (:func:`~lightning_seqpar.checkpoint.hf_export.export_hf_pretrained`):
        safetensors files of at most ``max_shard_size`` with their index, ``config.json``, and the tokenizer and
        generation files of the model directory ``source``. Collective: every rank must call it; published
        atomically.

        Args:
            out: the directory to write: new, empty, or a previous export (replaced atomically with ``overwrite``).
            config: the model's ``PretrainedConfig``; default: the ``config`` of the module under ``prefix``.
            prefix: the attribute path of the Hugging Face model in your LightningModule.
            source: where the tokenizer and generation files come from; default: the directory the config was
                loaded from (``config.name_or_path``), when it is one.
            dtype: the dtype written (default: the parameters').
            tokenizer: a tokenizer to save with the model (anything with ``save_pretrained(dir)``: the one the model
                was trained with); it replaces the tokenizer files copied from ``source``.
            overwrite: replace a previous export at ``out`` (recognized by its marker file).
            merge_lora: a PEFT-wrapped model: write ``W + (α/r)·B·A`` under the base model's keys, an ordinary
                Hugging Face directory (:class:`~lightning_seqpar.checkpoint.peft_export.MergedLoRA`); the
                adapters alone are exported by :func:`~lightning_seqpar.checkpoint.peft_export.export_peft_adapter`.

        Raises:
            ValueError: nothing under ``prefix``, a dtype safetensors cannot store, a bad ``max_shard_size``.
            FileExistsError: ``out`` holds anything but a previous export (or that, without ``overwrite``), or is
                (or holds) the run's folder, checkpoints or logs, or ``source``
                (:mod:`lightning_seqpar.checkpoint.destination`); on every rank, before anything is written.
        """
        assert self.module is not None
        wrapped = isinstance(getattr(self.module.get_submodule(prefix.rstrip(".")), "peft_config", None), dict)
        if wrapped and not merge_lora:
            raise ValueError("The model carries PEFT adapters: export them as a PEFT adapter directory "
                             "(lightning_seqpar.checkpoint.peft_export.export_peft_adapter), or pass merge_lora=True "
                             "for a Hugging Face directory of the merged weights.")
        if config is None:
            config = self.module.get_submodule(prefix.rstrip(".")).config
        if source is None and Path(str(getattr(config, "name_or_path", "") or "")).is_dir():
            source = config.name_or_path
        trainer = self.module.trainer
        kept = [source, trainer.default_root_dir, getattr(trainer.logger, "log_dir", None),
                *(getattr(c, "dirpath", None) for c in trainer.checkpoint_callbacks)]
        merged = MergedLoRA(self.module, prefix) if wrapped else None
        return export_hf_pretrained(self.module, self.mesh, process_group.broadcast(str(out)), config, prefix=prefix,
                                    source=source, max_shard_size=max_shard_size, dtype=dtype, tokenizer=tokenizer,
                                    overwrite=overwrite, protected=kept, view=merged and merged.names,
                                    transform=merged)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state for a checkpoint: DCP views (sharded format), or gathered per stage (full)."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        if self.config.format == "sharded":
            return optimizer_checkpoint_state(optimizer, self.module, self._shard_meshes)
        state = full_optimizer_state(optimizer, self.mesh)
        if self.mesh.pp == 1:
            return state
        # Each stage optimizes different layers: keep every stage's state, in pipeline-rank order.
        stages: list[Any] = [None] * self.mesh.pp
        dist.all_gather_object(stages, state, group=self.mesh.pipeline.group)
        return {"pipeline_stages": stages}

    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any],
             write_file: Callable[[dict[str, Any], Any, Optional[Any]], None]) -> None:
        """Sharded format: every rank writes its shards into the directory ``filepath``, published atomically
        (collective). Full format: rank 0 writes the file ``filepath`` atomically.

        Raises:
            TypeError: ``storage_options`` given with the sharded format.
        """
        if self.config.format == "full":  # marked: a plain Lightning file's optimizer state is told apart on load
            return write_file({**checkpoint, FULL_FORMAT_MARK: {"stages": self._stages}}, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(f"The sharded checkpoint format takes no storage_options, got {storage_options!r}.")
        assert self.module is not None and self.writer is not None
        path = Path(process_group.broadcast(str(filepath)))  # every rank writes into rank 0's directory
        shapes = merge_over_stages(single_device_shapes(self.module), self.mesh.pipeline)
        layout = {"tp": self.mesh.tp, "pp": self.mesh.pp, "dp": self.mesh.dp, "cp": self.mesh.cp,
                  **self._settings}
        frozen = self._frozen_record()
        if frozen is not None:  # every stage's frozen keys: the manifest says what a resume reads from the base
            keys = merge_over_stages({k: True for k in frozen.keys}, self.mesh.pipeline)
            layout["frozen_base"] = replace(frozen, keys=sorted(keys)).as_record()
        tied = merge_over_stages(tied_aliases(self.module), self.mesh.pipeline)
        save_trainer_checkpoint(self.writer, checkpoint, path, shapes, tied, layout)

    def wait(self) -> None:
        """Wait for a checkpoint still being published (before one is removed or read)."""
        if self.writer is not None:
            self.writer.wait()

    def load(self, checkpoint_path: Any, weights_only: Optional[bool],
             read_file: Callable[..., dict[str, Any]]) -> dict[str, Any]:
        """A sharded checkpoint directory is read in place, each rank its own shards of the model and (when
        fitting) of the optimizers, whatever layout wrote it; a full checkpoint file is read whole on every rank.
        What saves killed mid-write left in the checkpoint's folder is cleaned up first (a checkpoint whose save was
        killed between its two renames put back): a resumed run writes into a folder of its own, so the next save
        would never reach them."""
        assert self.module is not None
        path = Path(process_group.broadcast(str(checkpoint_path)))
        if dist.get_rank() == 0 and path.parent.is_dir():
            remove_stale_temporaries(path.parent)
        process_group.barrier(self._device)
        if path.is_dir() and not is_sharded_checkpoint(path):
            raise ValueError(not_a_checkpoint(path))
        if path.is_file() and is_sharded_checkpoint(path.parent):
            raise ValueError(f"{path} is one file of the sharded checkpoint {path.parent}: resume from the directory, "
                             f"ckpt_path={path.parent}.")
        if not is_sharded_checkpoint(path):
            if path.is_file() and is_zip_file(path):
                on_every_rank(lambda: check_zip_file(path))  # each rank checks what it reads
            return read_file(path, weights_only=weights_only)
        self.wait()
        return load_trainer_checkpoint(
            path, self.module, [getattr(o, "optimizer", o) for o in self._optimizers()], self._shard_meshes,
            self.module.strict_loading, self.config.allow_non_finite, weights_only,
            self.config.allow_unverified, self.frozen_base,
        )

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Lightning's ``load_model_state_dict``: a single-device state dict into this rank's shards and stage."""
        assert self.module is not None
        if FORMAT_KEY in checkpoint:  # a sharded checkpoint: read in place by load_checkpoint
            return
        state = checkpoint["state_dict"]
        if self.remote_keys:  # this stage's part; the other stages' layers must be there too
            missing = [k for k in self.remote_keys if k not in state]
            if strict and missing:
                raise KeyError(f"State dict mismatch. Missing (layers of other pipeline stages): {sorted(missing)}.")
            remote = set(self.remote_keys)
            state = {k: v for k, v in state.items() if k not in remote}

        def check() -> None:
            if not self.config.allow_non_finite:
                check_finite(state, "weight")
            check_state_dict_shapes(self.module, state)

        on_every_rank(check)
        load_full_state_dict(self.module, state, self.mesh, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Lightning's ``load_optimizer_state_dict``: a full checkpoint's optimizer state (zero=0)."""
        if FORMAT_KEY in checkpoint:  # a sharded checkpoint: read in place by load_checkpoint
            return
        if self._settings.get("zero"):
            raise ValueError("A full (single-file) checkpoint's optimizer state does not resume under zero=1; "
                             "resume with zero=0, or from a sharded checkpoint.")
        if self.mesh.pp > 1:  # (every rank reads the same file and settings: all raise alike)
            check_stage_placement(checkpoint.get(FULL_FORMAT_MARK), self._stages)
        try:
            states = on_every_rank(lambda: optimizer_states_of_this_stage(
                checkpoint["optimizer_states"], self._optimizers(), self.mesh.pp, self.mesh.pipeline.rank,
                self.config.allow_non_finite,
            ))
        except ValueError as error:
            if FULL_FORMAT_MARK in checkpoint:
                raise
            detail = str(error).split(" It was saved for another model")[0]
            raise ValueError(
                f"{detail}: the checkpoint was not written by SeqParallelStrategy (a plain Lightning or DDP checkpoint): "
                f"its optimizer state follows the single-device model's parameter order, which the parallel model does "
                f"not keep. Its weights load: call self.trainer.strategy.load_single_device_state_dict(PATH) in "
                f"configure_model() or on_fit_start() and train without ckpt_path (the optimizer starts afresh)."
            ) from None
        for optimizer, state in zip(self._optimizers(), states):
            load_full_optimizer_state(optimizer, state, self.mesh)
