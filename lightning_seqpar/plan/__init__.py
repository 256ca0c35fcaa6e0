"""Know before you rent: every layout of a model on N GPUs, its bytes per rank, FLOPs, traffic and step time.

- :mod:`.inventory`, :mod:`.models`: the model's parameters and how the strategy splits them (built on the meta
  device from its config);
- :mod:`.state`: model-state bytes per rank, exact (equal to what the strategy's ranks hold);
- :mod:`.probe`: a layer's activation bytes measured on small copies of the model and scaled (calibrated);
- :mod:`.activations`: the micro-batches in flight, the last stage's logits, and Table 2's model;
- :mod:`.transients`: what a step holds only for a moment at its peak (a backward's gradients, the optimizer's
  temporaries);
- :mod:`.cost`: the step-time model and the hardware rates; :mod:`.calibration`: rates measured on a machine, which
  ``python -m lightning_seqpar.plan calibrate`` (:mod:`.calibrate`) writes and the step-time model reads;
- :mod:`.planner`: :func:`plan`, the ranked records (:func:`predict`: one layout's); ``python -m lightning_seqpar.plan`` prints them;
- :mod:`.dry_run`: one rank built at full size on the meta device, its parameters against the prediction.
"""

from lightning_seqpar.plan.calibration import StepCalibration
from lightning_seqpar.plan.cost import Hardware
from lightning_seqpar.plan.inventory import ModelInventory, ParameterEntry
from lightning_seqpar.plan.models import inventory_of_hf_model, model_inventory
from lightning_seqpar.plan.layout_record import LayoutRecord
from lightning_seqpar.plan.planner import plan, predict
from lightning_seqpar.plan.state import StateBytes, state_bytes

__all__ = ["Hardware", "LayoutRecord", "ModelInventory", "ParameterEntry", "StateBytes", "StepCalibration",
           "inventory_of_hf_model",
           "model_inventory", "plan", "predict", "state_bytes"]
