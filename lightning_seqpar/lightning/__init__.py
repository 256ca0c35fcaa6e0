"""The Lightning integration: the strategy and everything it hands to Lightning (checkpoint hooks and IO,
precision plugins, the launcher, pipelined training/validation steps, callbacks). The only folder of the library
that imports Lightning, besides the reference models and the data module that users would write themselves."""

from lightning_seqpar.lightning.strategy import register

register()  # Trainer(strategy="seq_parallel" / "seq_parallel_tp2" ...) resolves from here on
