"""A test case's strategy from its compact settings (``Case.strategy`` pairs, a test's keywords): the
:class:`~lightning_seqpar.Layout`'s fields go into the layout, the others into the settings object owning them."""

from dataclasses import fields

from lightning_seqpar import Layout, SeqParallelStrategy

LAYOUT_FIELDS = {f.name for f in fields(Layout)} - {"tp", "pp", "cp", "ep"}
OWNERS = {
    "checkpointing": {"checkpoint_format": "format", "async_save": "async_save",
                      "allow_non_finite_checkpoint": "allow_non_finite",
                      "allow_unverified_checkpoint": "allow_unverified"},
    "precision_config": {"low_precision_residual": "low_precision_residual"},
    "rewriting": {"policies": "policies", "verify_rewrite": "verify", "compile": "compile"},
    "launch": {"start_method": "start_method", "timeout": "timeout", "process_group_backend": "backend"},
}


def strategy_of(tp=1, pp=1, cp=1, ep=1, **settings) -> SeqParallelStrategy:
    layout = {name: settings.pop(name) for name in list(settings) if name in LAYOUT_FIELDS}
    grouped = {owner: {new: settings.pop(old) for old, new in names.items() if old in settings}
               for owner, names in OWNERS.items()}
    return SeqParallelStrategy(tp=tp, pp=pp, cp=cp, ep=ep, layout=Layout(**layout) if layout else None,
                               **{owner: values for owner, values in grouped.items() if values}, **settings)
