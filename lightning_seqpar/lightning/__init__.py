"""The Lightning integration: the strategy and everything it hands to Lightning (checkpoint hooks and IO,
precision plugins, the launcher, pipelined training/validation steps, callbacks). The only folder of the library
that imports Lightning, besides the reference models and the data module that users would write themselves."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_seqpar.lightning.strategy import SeqParallelStrategy


def register() -> None:
    """Make ``Trainer(strategy="seq_parallel")`` (``tp=1``) and ``"seq_parallel_tp2"`` / ``_tp4`` / ``_tp8``
    resolve to :class:`SeqParallelStrategy`; other layouts: pass ``SeqParallelStrategy(tp=..., pp=...)``."""
    if SeqParallelStrategy.strategy_name not in StrategyRegistry:
        SeqParallelStrategy.register_strategies(StrategyRegistry)


register()  # Trainer(strategy="seq_parallel" / "seq_parallel_tp2" ...) resolves from here on
