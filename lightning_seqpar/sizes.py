"""Byte sizes as users write them: ``24GB``, ``24G``, ``24GiB``, ``80 GB``, ``24e9`` — one reading for the planner's
command line, the recipes' Hydra options, :class:`~lightning_seqpar.lightning.auto_layout.AutoLayout` and the export's
``max_shard_size``.

Decimal units (``K``/``KB``, ``M``/``MB``, ``G``/``GB``, ``T``/``TB``: powers of 1000, as ``save_pretrained`` and GPU
data sheets count) and binary ones (``KiB``, ``MiB``, ``GiB``, ``TiB``), in any case. Text without a unit is bytes only
from 1 MiB up: ``--gpu-memory 24`` meant as gigabytes would otherwise be read as 24 bytes, silently. A Python number is
bytes, as the APIs document.
"""

from __future__ import annotations

import re
from typing import Union

_UNITS = {"B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9, "T": 10**12,
          "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
SMALLEST_UNITLESS = 2**20
"""bytes: text without a unit below this is refused (``"24"`` is 24 bytes, surely meant as ``24GB``)"""
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*")


def parse_bytes(value: Union[int, float, str], name: str = "size") -> int:
    """Bytes from a size as written: an int or float of bytes (``24e9``), or text ``"24GB"``, ``"24G"``, ``"24GiB"``,
    ``"80 GB"``, ``"24e9"``.

    Raises:
        ValueError: not a size, an unknown unit, a size that is not positive, or text without a unit below
            :data:`SMALLEST_UNITLESS` bytes — naming ``name``, the value and the fix.
    """
    example = f"give a unit, e.g. {name}=24GB (10^9 bytes) or 24GiB (2^30), or bytes as 24e9"
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not a size: {example}.")
    if isinstance(value, (int, float)):
        number, unit = float(value), "B"
    else:
        match = _SIZE.fullmatch(str(value))
        if match is None:
            raise ValueError(f"{name}={value!r} is not a size: {example}.")
        number, unit = float(match.group(1)), match.group(2).upper()
        if unit and unit not in _UNITS:
            raise ValueError(f"{name}={value!r}: unknown unit {match.group(2)!r}; {example}.")
    if not number > 0:
        raise ValueError(f"{name}={value!r} is not a positive size: {example}.")
    if not unit and number < SMALLEST_UNITLESS:
        raise ValueError(f"{name}={value!r} has no unit and would be {number:g} bytes: {example}.")
    return int(round(number * _UNITS[unit or "B"]))
