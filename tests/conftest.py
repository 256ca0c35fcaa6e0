"""Test lanes: ``tests/unit`` runs in one process; ``tests/distributed`` starts processes (gloo on CPU).

Every test under ``tests/distributed`` is marked ``distributed``, so ``python -m pytest -m "not distributed"``
is the fast lane.
"""

from pathlib import Path

import pytest

_DISTRIBUTED = Path(__file__).parent / "distributed"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _DISTRIBUTED in Path(item.fspath).parents:
            item.add_marker(pytest.mark.distributed)
