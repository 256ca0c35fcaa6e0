"""What the planner reads off models and machines: a model's inventory (built on the meta device and rewritten by
the strategy's own rewrite), the activation and work probes on small copies, the machine's calibration and its file
format, the cache that keeps them, and the dry run of one rank at full size.
"""
