"""Activation bytes of a model's layer measured on small copies, then scaled: the planner's calibrated per-layer figure.

Table 2 counts what Megatron's layer keeps; a Hugging Face layer keeps more (float32 copies of its norms' inputs,
the float32 softmax beside its 16-bit copy, rotary and key/value-repeat copies), and each family differs. So the
planner measures instead of assuming: a small copy of the model
(:func:`~lightning_seqpar.hf.model_check.small_config`: its class and heads, three layers, small widths) is rewritten
for rank 0 of t ranks, its peers mirrored (:class:`~lightning_seqpar.parallel.mirrored.MirroredGroup`: the shapes
they would send, at the cost of one rank), with the layout's sequence parallelism and recomputation, called as users
call it (``model(input_ids=x, labels=x)``) in the run's dtype (``bf16-mixed`` under CUDA autocast's rule for norms and
softmax, :mod:`lightning_seqpar.memory.cuda_autocast`: what a GPU keeps), and the bytes its middle layer leaves alive
for backward (what it made: its input is the layer before's) are read by
:class:`~lightning_seqpar.memory.tracker.LiveActivationTracker`.

Every tensor a layer keeps is ``b × s × (a width or a constant)``, ``b × heads × s²`` in core attention, or shared by
the batch (a mask ``s²``, rotary tables ``s·d``, weights cast by autocast ``d²``, ``d·f``, and LoRA's adapters of a
fixed rank ``d``, ``f``), so with the heads fixed the bytes are a sum of the ten terms :data:`TERMS` (d values per head,
f the MLP width). Twelve probes of different ``(b, s, d, f)`` give their coefficients (least squares), a thirteenth
checks the fit, and the full size follows exactly.
Source: the mock-module estimators that measured within −1.3 %…+0.5 % where the closed forms were 7–15 % low.

What a forward keeps outside its layers (embedding, the last layer's gathered output, final norm, LM head, loss) is
fitted the same way over ``(b, s, d, v)`` from the same probes (each measures the whole forward too, v varied
beside the rest): :func:`fit_outside`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch

from lightning_seqpar.plan.measuring.probe_models import ProbeModels, probe_models
from lightning_seqpar.plan.pricing.kept import first_layer_apart

TERMS = ("bsd", "bsf", "bss", "bs", "ss", "sd", "dd", "df", "d", "f")
# (b, s, d, f, v) of the probes, s, f and v times t; the last checks the fits. The layer's and the outside's fits read
# the same probes (each measures both). More probes than terms, three values of d and of f: a term the probes cannot
# tell apart from another is spread over the others by the fit (LoRA's adapter weight copies under bf16-mixed are a
# "d" term, which two values of d and no "d" term misplaced). Micro-batches of 2 and 4: at b = 1 the first
# layer's [s, b, h] input is a view of the embedding's output, from b = 2 a copy of it (what the first layer and what
# the outside keep are then linear in b; their sum is the same at b = 1).
_PROBES = ((2, 8, 8, 16, 64), (4, 8, 8, 16, 64), (2, 16, 8, 16, 64), (2, 8, 16, 16, 64), (2, 8, 8, 32, 128),
           (4, 16, 8, 16, 128), (2, 16, 16, 16, 128), (2, 8, 16, 32, 96), (4, 8, 16, 32, 64), (2, 8, 24, 16, 128),
           (2, 24, 8, 48, 64), (4, 8, 8, 48, 96), (4, 16, 16, 32, 128))
PROBES_PER_FIT = len(_PROBES)
"""The probes one fit measures (what more probe workers than this would wait for)."""
_DTYPES = {"32-true": torch.float32, "bf16-true": torch.bfloat16, "bf16-mixed": torch.float32,
           "64-true": torch.float64}


def _terms(b: int, s: int, d: int, f: int) -> list[float]:
    return [b * s * d, b * s * f, b * s * s, b * s, s * s, s * d, d * d, d * f, d, f]


@dataclass(frozen=True)
class LayerFit:
    """Bytes one layer keeps per micro-batch: ``Σ coefficients[k] · TERMS[k]`` (see the module docstring), and the
    fit's relative error on the check probe."""

    coefficients: tuple[float, ...]
    check_error: float
    first: Optional[tuple[float, ...]] = None
    """the same for the first layer, where parameters are frozen (LoRA): its input, the frozen embedding's output,
    needs no gradient, so it keeps less (but, under full recomputation, the layers' ``[s, b, h]`` copy of that
    input, which its checkpoint keeps); ``None``: as the others, its input's copy counted outside the layers"""

    def bytes(self, s: int, b: int, head_dim: int, ffn: int, quadratic: bool = True) -> float:
        """All the layer keeps for one micro-batch; without ``quadratic``, less the ``s²`` terms (what the explicit
        core attention keeps: a context-parallel layer's blockwise attention keeps none)."""
        return _fitted(self.coefficients, _terms(b, s, head_dim, ffn), quadratic)

    def mlp_bytes(self, s: int, b: int, head_dim: int, ffn: int) -> float:
        """What the MLP keeps of it for one micro-batch: the terms in its width ``f`` (its inner activations
        ``b·s·f``, autocast's copies of its weights ``d·f``, its adapters' ``f``), which its backward frees before
        the attention's backward runs."""
        terms = _terms(b, s, head_dim, ffn)
        return max(0.0, sum(c * term for name, c, term in zip(TERMS, self.coefficients, terms) if "f" in name))

    def first_layer_saving(self, s: int, b: int, head_dim: int, ffn: int, quadratic: bool = True) -> float:
        """What the first layer keeps less than the others for one micro-batch (0 where :attr:`first` is ``None``):
        below 0 where it keeps more (under full recomputation its checkpoint keeps its input as the layers lay it
        out, ``[s, b, h]``: a copy the first layer makes of the embedding's ``[b, s, h]`` output where ``b > 1``,
        beside its own output)."""
        if self.first is None:
            return 0.0
        terms = _terms(b, s, head_dim, ffn)
        return _fitted(self.coefficients, terms, quadratic) - _fitted(self.first, terms, quadratic)


def _fitted(coefficients: tuple[float, ...], terms: list[float], quadratic: bool) -> float:
    return sum(c * term for k, (c, term) in enumerate(zip(coefficients, terms))
               if quadratic or TERMS[k] not in ("bss", "ss"))


def measure_layer(config: Any, tp: int, sequence_parallel: bool, recompute: str, precision: str, s: int, b: int,
                  overrides: Optional[dict] = None, whole: bool = False, modules: tuple[str, ...] = (),
                  offload: tuple[str, ...] = (), training: Any = None) -> int:
    """Bytes the middle decoder layer of a small copy of the model of ``config`` keeps for backward on rank 0 of
    ``tp`` ranks (see the module docstring); ``whole``: what the whole forward keeps. ``modules``:
    recomputation by module beside ``recompute``; ``offload``: modules whose saved tensors go to a host pool (the
    device bytes are what is measured); ``training``: the run's LoRA and frozen parameters
    (:class:`~lightning_seqpar.plan.measuring.trained.TrainedParts`), copied onto the small model before its rewrite."""
    kept = measure(config, tp, sequence_parallel, recompute, precision, s, b, overrides, modules, offload, training)
    return kept.everything if whole else kept.layer


class Measured(NamedTuple):
    """What one probe's forward keeps for backward on rank 0, in bytes (see :func:`measure`)."""

    layer: int
    """the middle layer's"""
    everything: int
    """the whole forward's"""
    prologue: int
    """what the base model makes before its layers besides the embedding (the attention mask, the rotary tables, the
    position ids), which every pipeline stage's forward makes again"""
    first: int
    """the first layer's (less than the middle one's where the embedding is frozen)"""


def measure(config: Any, tp: int, sequence_parallel: bool, recompute: str, precision: str, s: int, b: int,
            overrides: Optional[dict] = None, modules: tuple[str, ...] = (),
            offload: tuple[str, ...] = (), training: Any = None, split: bool = False,
            models: Optional[ProbeModels] = None) -> Measured:
    """The bytes the probe's middle layer, whole forward, prologue and first layer keep for backward
    (:class:`Measured`; see :func:`measure_layer`). ``split``: the layers run as under a split backward (ZB-H1, ZB-V,
    DualPipeV: :func:`~lightning_seqpar.tensor_parallel.split_backward.split_weight_gradients`), whose linears keep
    their float32 weights and one 16-bit cast of a shared input where torch's own linear keeps autocast's copies.
    ``models``: the small models built so far, copied instead of built again."""
    from lightning_seqpar.hf.model_check import parts_in_order
    from lightning_seqpar.memory.cuda_autocast import cuda_autocast_rules
    from lightning_seqpar.memory.tracker import LiveActivationTracker
    from lightning_seqpar.parallel.mirrored import MirroredGroup

    small, x = probe_input(config, tp, s, b, overrides)
    model = probe_model(small, _DTYPES[precision], MirroredGroup(tp), sequence_parallel, recompute, modules, offload,
                        training, split, models)
    parts = parts_in_order(model)  # the embedding, the three layers, the parts after them
    # what a GPU keeps: CUDA autocast runs norms and softmax in float32
    rules = cuda_autocast_rules() if precision == "bf16-mixed" else contextlib.nullcontext()
    with rules, torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"), \
            LiveActivationTracker(model) as tracker:
        out = model(input_ids=x, labels=x)
    stack = parts[1].rpartition(".")[0]
    base = stack.rpartition(".")[0]
    prologue = (tracker.live_bytes(base) - tracker.live_bytes(stack) - tracker.live_bytes(parts[0])
                - sum(tracker.live_bytes(part) for part in parts[4:])) if base else 0
    kept = Measured(tracker.live_bytes(parts[2]), tracker.live_bytes(), prologue, tracker.live_bytes(parts[1]))
    del out
    return kept


def probe_input(config: Any, tp: int, s: int, b: int, overrides: Optional[dict] = None,
                layers: int = 3) -> tuple[Any, torch.Tensor]:
    """The small config of a probe (``layers`` layers, :func:`_small_overrides`) and its tokens ``[b, s]`` (seeded)."""
    from lightning_seqpar.hf.model_check import small_config

    if getattr(config, "n_positions", None) is not None and config.n_positions < s:
        # learned positions (GPT-2) as long as the probe's sequence: a probe longer than the model's own is still the
        # same layer's bytes, scaled by s
        overrides = dict(overrides or {}, n_positions=s)
    small = small_config(config, tp, _small_overrides(config, overrides, layers))
    return small, torch.randint(0, small.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))


def probe_model(small: Any, dtype: torch.dtype, group: Any, sequence_parallel: bool, recompute: str,
                modules: tuple[str, ...] = (), offload: tuple[str, ...] = (), training: Any = None,
                split: bool = False, models: Optional[ProbeModels] = None) -> torch.nn.Module:
    """The small model of ``small`` (a config) as the run builds it on ``group``'s rank: trained parts (LoRA,
    frozen names) copied on, cast to ``dtype``, rewritten with ``sequence_parallel``, then recomputation
    (``recompute`` and by ``modules``), ``offload`` and the split backward (``split``) applied; in training mode.
    ``models``: where the rewritten small model is copied from (built there once,
    :class:`~.probe_models.ProbeModels`)."""
    from lightning_seqpar.offload import HostPool, apply_offload
    from lightning_seqpar.recompute import apply_recompute, apply_recompute_modules
    from lightning_seqpar.tensor_parallel.split_backward import split_weight_gradients
    from lightning_seqpar.tensor_parallel.weight_gradients import WeightGradientStore

    model = (models or ProbeModels(most=0)).rewritten(small, training, dtype, group, sequence_parallel)
    if recompute != "none":
        apply_recompute(model, recompute)
    if modules:  # by module: the modules with what recompute already recomputes
        apply_recompute_modules(model, [*modules, *({"selective": ["core_attn"], "full": ["full"]}.get(
            recompute, []))])
    if offload:
        apply_offload(model, list(offload), HostPool("cpu"))
    if split:  # (a forward alone defers nothing, so the store stays empty)
        split_weight_gradients(model, WeightGradientStore())
    return model


def _small_overrides(config: Any, overrides: Optional[dict], layers: int = 3) -> dict:
    """Three layers (the middle one is measured; the last gathers its output under SP), or ``layers``, per-layer
    lists cut (or, for a model of fewer layers, repeated) to match, and ``overrides``."""
    total = getattr(config, "num_hidden_layers", None) or config.n_layer
    per_layer = {k: (v * layers)[:layers] for k, v in vars(config).items() if isinstance(v, list) and len(v) == total}
    return dict(num_hidden_layers=layers, n_layer=layers, **per_layer, **(overrides or {}))


def fit_layer(config: Any, tp: int, sequence_parallel: bool = True, recompute: str = "selective",
              precision: str = "bf16-mixed", experts: Any = None, modules: tuple[str, ...] = (),
              offload: tuple[str, ...] = (), training: Any = None, split: bool = False,
              measured: Optional[dict] = None) -> LayerFit:
    """The coefficients of :class:`LayerFit` for ``config``'s layer under the layout, from the probes (``modules``,
    ``offload``: recomputation by module and activation offload; ``training``: the run's LoRA and frozen parameters,
    :class:`~lightning_seqpar.plan.measuring.trained.TrainedParts`; each applied to the probes as to the run).
    ``measured``: the probes already measured, shared with :func:`fit_outside` (each probe is measured once per layout).

    ``experts``: the model's :class:`~lightning_seqpar.plan.pricing.model_inventory.ExpertShape` (a mixture of
    experts). Its probes keep the layer's widths in proportion: for a probe width ``f`` (the MLP width a token goes
    through,
    ``k·f_e + f_shared``) each expert is ``f·f_e / (k·f_e + f_shared)`` wide and the shared MLP the rest, the expert
    count and k the model's. The experts are whole on the probe's ranks (ep = 1): each rank computes its own
    ``s/t·b`` tokens' ``k`` rows, as a rank of any ep does on average (balanced routing); the planner removes the
    autocast copies of the ``E − E/e`` experts a rank of ep ``e`` does not hold.

    Raises:
        ValueError: an unknown precision or recomputation (from the rewrite: a layout the model refuses).
    """
    rows, kept, first = [], [], []
    for (b, s, d, f, _), probed in _probes(config, tp, sequence_parallel, recompute, precision, experts, modules,
                                           offload, training, split, measured):
        rows.append(_terms(b, s, d, f))
        kept.append(float(probed.layer))
        first.append(float(probed.first))
    # the first layer is fitted apart where parameters are frozen (its input may need no gradient); else it keeps
    # what the others keep and the layers' [s, b, h] copy of its input, which the outside's fit counts as its input
    apart = _least_squares(rows, first)[0] if first_layer_apart(training) else None
    return LayerFit(*_least_squares(rows, kept), apart)


def _probes(config: Any, tp: int, sequence_parallel: bool, recompute: str, precision: str, experts: Any,
            modules: tuple[str, ...], offload: tuple[str, ...], training: Any, split: bool,
            measured: Optional[dict]) -> list[tuple[tuple[int, int, int, int, int], Measured]]:
    """The sizes ``(b, s, d, f, v)`` of each probe of :data:`_PROBES` on ``tp`` ranks (s, f and v times t, d a multiple
    of the smallest head size the model allows) and what it keeps (:func:`measure`), from ``measured`` where there;
    the others measured at once, on the workers of a :func:`~.probe_pool.probe_pool` where ``measured`` holds one.

    Raises:
        ValueError: an unknown precision.
    """
    if precision not in _DTYPES:
        raise ValueError(f"precision={precision!r}: one of {sorted(_DTYPES)}.")
    from lightning_seqpar.hf.model_check import probe_head_dim
    from lightning_seqpar.plan.measuring.probe_pool import KEY

    heads = getattr(config, "num_attention_heads", None) or config.n_head
    split = split and split_changes_what_is_kept(precision, recompute)  # (else the unsplit probes serve both)
    text = None
    if measured is not None:
        text = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else repr(config)
    sizes, keys, calls = [], [], []
    for index, (b, s, d, f, v) in enumerate(_PROBES):
        s, d, f, v = s * tp, d // 4 * probe_head_dim(config), f * tp, v * tp
        overrides = dict(head_dim=d, hidden_size=heads * d, n_embd=heads * d, intermediate_size=f, n_inner=f,
                         ffn_hidden_size=f, vocab_size=v)
        if experts is not None:
            overrides.update(_expert_widths(experts, f))
        sizes.append((b, s, d, f, v))
        keys.append(None if measured is None else (
            "probe", text, None if training is None else training.key, tp, sequence_parallel, recompute, precision, b,
            s, tuple(sorted(overrides.items())), modules, offload, split))
        if measured is None or keys[-1] not in measured:
            calls.append((index, (config, tp, sequence_parallel, recompute, precision, s, b, overrides, modules,
                                  offload, training, split)))
    pool = None if measured is None or not calls else measured.get(KEY)
    if pool is not None:
        found = pool.measure(measure, calls)
    else:
        models = probe_models(measured) if calls else None
        found = [measure(*arguments, models=models) for _, arguments in calls]
    probed = dict(zip((index for index, _ in calls), found))
    for index, value in probed.items():
        if measured is not None:
            measured[keys[index]] = value
    return [(size, probed[i] if i in probed else measured[keys[i]]) for i, size in enumerate(sizes)]


def split_changes_what_is_kept(precision: str, recompute: str) -> bool:
    """Whether a forward run as under a split backward keeps other bytes than one run whole, so that its probes are
    measured apart: the split linears keep their weights and a 16-bit cast of a shared input where torch's linear
    keeps autocast's 16-bit copies (``bf16-mixed``), which a layer recomputed whole (``full``) keeps none of; under
    ``bf16-true`` there is no autocast. (Equal, byte for byte, for Llama with and without LoRA, Qwen3-MoE and GPT-2 at
    tp 1 and 2: ``tests/plan/test_probe_measurement.py``; under ``32-true`` a mixture recomputed whole keeps 512
    bytes more split, so ``32-true`` is measured apart.)"""
    return precision != "bf16-true" and not (precision == "bf16-mixed" and recompute == "full")


def _expert_widths(experts: Any, f: int) -> dict[str, int]:
    """The config keys of each expert's width (``moe_intermediate_size``; ``intermediate_size`` where the family has no
    other, Mixtral, gpt-oss, OLMoE) and of the shared MLP's, in the model's proportions for a probe width ``f``."""
    total = experts.top_k * experts.expert_ffn + experts.shared_ffn
    width = max(1, round(f * experts.expert_ffn / total))
    shared = max(1, round(f * experts.shared_ffn / total)) if experts.shared_ffn else 0
    return dict(moe_intermediate_size=width, intermediate_size=width, shared_expert_intermediate_size=shared)


def _least_squares(rows: list[list[float]], kept: list[float]) -> tuple[tuple[float, ...], float]:
    """The coefficients that give ``kept`` from the terms ``rows`` (all but the last probe), and the relative error
    they make on the last probe."""
    a = torch.tensor(rows[:-1], dtype=torch.float64)
    solution = torch.linalg.lstsq(a, torch.tensor(kept[:-1], dtype=torch.float64).unsqueeze(1)).solution.flatten()
    coefficients = tuple(round(c, 6) for c in solution.tolist())
    predicted = sum(c * term for c, term in zip(coefficients, rows[-1]))
    return coefficients, abs(predicted - kept[-1]) / max(kept[-1], 1.0)


OUTSIDE_TERMS = ("bsd", "bsv", "bs", "sd", "ss", "dv", "bss", "s", "v", "d")


def _outside_terms(b: int, s: int, d: int, v: int) -> list[float]:
    return [b * s * d, b * s * v, b * s, s * d, s * s, d * v, b * s * s, s, v, d]


@dataclass(frozen=True)
class OutsideFit:
    """Bytes a forward keeps outside its layers (the embedding, the base model's prologue, the last layer's gathered
    output, the final norm, the LM head and the loss): ``Σ coefficients[k] · OUTSIDE_TERMS[k]`` (v the vocabulary);
    of them, the prologue (:func:`measure`): ``Σ prologue[k] · OUTSIDE_TERMS[k]``; and the check probe's error."""

    coefficients: tuple[float, ...]
    check_error: float
    prologue: tuple[float, ...] = ()

    def bytes(self, s: int, b: int, head_dim: int, vocab: int) -> float:
        return sum(c * term for c, term in zip(self.coefficients, _outside_terms(b, s, head_dim, vocab)))

    def prologue_bytes(self, s: int, b: int, head_dim: int, vocab: int) -> float:
        """What every pipeline stage's forward makes before its layers (the mask, rotary tables, position ids)."""
        return sum(c * term for c, term in zip(self.prologue, _outside_terms(b, s, head_dim, vocab)))


def fit_outside(config: Any, tp: int, sequence_parallel: bool = True, precision: str = "bf16-mixed",
                training: Any = None, recompute: str = "none", experts: Any = None,
                measured: Optional[dict] = None) -> OutsideFit:
    """:class:`OutsideFit` for ``config`` at ``tp``: the whole forward's bytes less its three layers' (the first one's
    own, twice the middle one's), on the probes :func:`fit_layer` reads (``training``, ``experts``, ``measured``: as
    its; a frozen head keeps no input for its weight gradient). ``recompute``: the layers' recomputation, which
    decides whether the prologue's attention mask is kept (a checkpointed attention saves its inputs, the mask among
    them: a ``[b, 1, s, s]`` tensor per micro-batch in flight, which the explicit attention's add does not keep)."""
    rows, kept, prologues = [], [], []
    for (b, s, d, _, v), probed in _probes(config, tp, sequence_parallel, recompute, precision, experts, (), (),
                                           training, False, measured):
        rows.append(_outside_terms(b, s, d, v))
        # Where parameters are frozen (LoRA) the first layer is priced apart (:attr:`LayerFit.first`: under
        # bf16-mixed its frozen projections keep no 16-bit weight copies), so it is taken off as it is; else as a
        # middle one, the outside keeping the first layer's copy of its input (the stage input).
        first = probed.first if first_layer_apart(training) else probed.layer
        kept.append(float(probed.everything - 2 * probed.layer - first))
        prologues.append(float(probed.prologue))
    coefficients, error = _least_squares(rows, kept)
    return OutsideFit(coefficients, error, _least_squares(rows, prologues)[0])
