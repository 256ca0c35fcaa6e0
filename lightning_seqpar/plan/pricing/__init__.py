"""The planner's arithmetic: a layout's rules, bytes per rank by moment, FLOPs, traffic and step time, from a model's
inventory and what was measured, both as data. Imports no torch: ``tests/package/test_layering.py`` holds it to that.
"""
