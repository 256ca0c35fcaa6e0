"""Know before you rent: every layout of a model on N GPUs, its bytes per rank, FLOPs, traffic and step time.

Three parts, each importing only the ones before it:

- :mod:`.pricing`: the arithmetic, importing no torch (a layering test holds it to that). It takes the model as data
  (:class:`ModelInventory`: every parameter and how the strategy splits it) and what was measured as data (the
  probes' fits through :class:`~.pricing.measurements.Measurements`, the machine's rates through
  :class:`~.pricing.cost.MeasuredRates`), and gives each layout's rules, model state (:mod:`.pricing.state`, exact),
  activations (:mod:`.pricing.kept`, :mod:`.pricing.activations`: Table 2's model where nothing was measured),
  transients, peak by moment (:mod:`.pricing.peak`) and step time (:mod:`.pricing.cost`).
- :mod:`.measuring`: what is read off models and machines: the inventory of a model built on the meta device
  (:mod:`.measuring.inventory`, :mod:`.measuring.models`), the activation and work probes on small copies
  (:mod:`.measuring.probe`, :mod:`.measuring.work`, served to pricing by :mod:`.measuring.fits`), the calibration and
  its file format (``python -m lightning_seqpar.plan calibrate``), the on-disk cache, and the dry run (one rank built
  at full size on the meta device, its parameters against the prediction).
- :mod:`.planner`: :func:`plan`, the ranked records (:func:`predict`: one layout's), and the command line
  (``python -m lightning_seqpar.plan``, :mod:`.__main__`) that prints them.
"""

from lightning_seqpar.plan.measuring.calibration import StepCalibration
from lightning_seqpar.plan.pricing.cost import Hardware
from lightning_seqpar.plan.pricing.model_inventory import ModelInventory, ParameterEntry
from lightning_seqpar.plan.measuring.models import inventory_of_hf_model, model_inventory
from lightning_seqpar.plan.pricing.layout_record import LayoutRecord
from lightning_seqpar.plan.planner import plan, predict
from lightning_seqpar.plan.pricing.state import StateBytes, state_bytes

__all__ = ["Hardware", "LayoutRecord", "ModelInventory", "ParameterEntry", "StateBytes", "StepCalibration",
           "inventory_of_hf_model",
           "model_inventory", "plan", "predict", "state_bytes"]
