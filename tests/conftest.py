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


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A tiny pretrained Llama directory (3 safetensors files, a 66 000-token BPE tokenizer trained offline) and the
    text its tokenizer was trained on; built once per test session."""
    from tests.helpers.hf_model_dir import make_model_dir, synthetic_text

    text = synthetic_text(120_000)
    return make_model_dir(tmp_path_factory.mktemp("hf_model") / "tiny-llama", text), text
