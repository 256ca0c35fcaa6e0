"""The Lightning integration: the strategy and everything it hands to Lightning (checkpoint hooks and IO,
precision plugins, the launcher, pipelined training/validation steps, callbacks). The only folder of the library
that imports Lightning, besides the reference models and the data module that users would write themselves."""
