"""A LoRA checkpoint exported by one process as the PEFT adapter directory it trained: what
``python -m lightning_seqpar.checkpoint export-hf`` writes for a checkpoint whose model is PEFT-wrapped.

Such a checkpoint holds the adapters only (its frozen base stays in the pretrained directory it was read from,
:mod:`~lightning_seqpar.checkpoint.frozen_base`), so its Hugging Face form is the adapter directory
``PeftModel.from_pretrained(base, DIR)`` (or ``AutoPeftModelForCausalLM.from_pretrained(DIR)``, through the config's
``base_model_name_or_path``) loads: ``adapter_model.safetensors`` under PEFT's keys (``base_model.model.<module>.
lora_A.weight``, the adapter's name dropped, as ``get_peft_model_state_dict`` saves them) and ``adapter_config.json``
(the adapter directory the run started from, or PEFT's ``LoraConfig`` of the run's recorded ``lora`` settings), as
:func:`~lightning_seqpar.checkpoint.peft_export.export_peft_adapter` writes at the end of a run. Published atomically.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Optional

from lightning_seqpar.checkpoint.atomic import publish, temporary_path
from lightning_seqpar.checkpoint.destination import mark_export, refuse_export_destination
from lightning_seqpar.checkpoint.peft_adapter import lora_config
from lightning_seqpar.hf.streaming import SafetensorsStreamWriter, TensorEntry

ADAPTER_FILE, CONFIG_FILE = "adapter_model.safetensors", "adapter_config.json"
_ADAPTER_KEY = re.compile(r"^(?:.*?\.)?(base_model\.model\..*\.lora_[AB])\.[^.]+\.weight$")


def adapter_keys(shapes: dict[str, Any]) -> dict[str, str]:
    """``{stored key: PEFT's saved key}`` of every LoRA matrix a checkpoint holds (empty: not a LoRA checkpoint)."""
    return {key: f"{match.group(1)}.weight" for key in shapes if (match := _ADAPTER_KEY.match(key))}


def adapter_config(hparams: dict, base: Optional[str]) -> dict:
    """The ``adapter_config.json`` of a run: its adapter directory's own when it started from one, else PEFT's
    ``LoraConfig`` of the recorded ``lora`` settings (:func:`~.peft_adapter.lora_config`), naming
    ``base`` as the base model.

    Raises:
        ValueError: neither recorded (the checkpoint was not written by ``FineTuneModule``), naming the fix.
        ImportError: PEFT not installed, with the install command.
    """
    if hparams.get("adapter"):
        config = json.loads((Path(hparams["adapter"]) / CONFIG_FILE).read_text())
    elif isinstance(hparams.get("lora"), dict):
        config = lora_config(hparams["lora"]).to_dict()
    else:
        raise ValueError("The checkpoint holds LoRA adapters but records no LoRA settings (it was not written by "
                         "FineTuneModule): export the adapters from the run with export_peft_adapter.")
    config["inference_mode"] = True
    if base is not None:
        config["base_model_name_or_path"] = str(base)
    return json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)))


def export_adapter(stored: Any, out: Path, base: Optional[str], overwrite: bool) -> Path:
    """Write the adapters of the LoRA checkpoint ``stored`` (a :class:`~.consolidate.StoredModel`) as the PEFT
    adapter directory ``out``; ``base``: the base model directory (``--config``, or the recorded pretrained one).

    Raises:
        ValueError: no LoRA settings recorded; FileExistsError: a destination that must not be written.
    """
    hparams = stored.trainer_state.get("hyper_parameters") or {}
    base = base or hparams.get("pretrained")
    keys = adapter_keys(stored.shapes)
    config = adapter_config(hparams, base)
    refuse_export_destination(out, overwrite=overwrite, protected=(stored.path, base))
    ordered = sorted(keys.items(), key=lambda item: item[1])
    entries = [TensorEntry(saved, stored.dtype(key), tuple(stored.shapes[key])) for key, saved in ordered]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(out)
    tmp.mkdir()
    try:
        with SafetensorsStreamWriter(tmp / ADAPTER_FILE, entries) as writer:
            for key, saved in ordered:
                writer.write(saved, stored.read(key).contiguous())
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
        mark_export(tmp, "adapter", digests=True)
        stored.close()  # read: its folder's lock released before publishing
        publish(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out
