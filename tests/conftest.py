"""Tests by concept: ``tests/<folder>`` mirrors ``lightning_seqpar/<folder>`` (plus ``package/`` for the package's
structure and versions, ``recipes/`` for the recipes). A test module that starts processes (gloo on CPU) says so with
``pytestmark = pytest.mark.distributed``, so ``python -m pytest -m "not distributed"`` is the fast single-process lane;
a module that uses the multi-process helpers without the mark is refused at collection.

The suite runs on two test workers (pytest-xdist, ``-n 2`` in ``setup.cfg``; ``-n 0`` runs it in one process). A test
whose assertion is a wall-clock bound (a job ends within seconds of a fault) says so with ``pytest.mark.exclusive``:
it runs with no other test beside it, so its bound is the one measured on an idle machine.
"""

import fcntl
import os
import tempfile
from pathlib import Path

import pytest

_STARTS_PROCESSES = ("run_distributed", "run_cases", "start_recipe")  # the multi-process helpers


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = set()
    for item in items:
        module = getattr(item, "module", None)
        if module is None or item.get_closest_marker("distributed") is not None:
            continue
        if any(name in vars(module) for name in _STARTS_PROCESSES):
            unmarked.add(Path(str(item.fspath)).name)
    if unmarked:
        raise pytest.UsageError(f"{sorted(unmarked)} start processes but are not marked: add "
                                f"`pytestmark = pytest.mark.distributed` (the fast lane must stay single-process).")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Across the test workers, a readers-writer lock: every test holds it shared from its setup to its teardown, an
    ``exclusive`` one holds it alone. One file per run, named by the run's id that pytest-xdist gives its workers."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:  # one process: nothing runs beside any test
        return (yield)
    exclusive = item.get_closest_marker("exclusive") is not None
    with open(Path(tempfile.gettempdir()) / f"lightning_seqpar-tests-{run}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            return (yield)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _rendezvous_restored():
    """A test that runs a launcher in this process (Lightning's spawn launcher, a single-process strategy) leaves its
    rendezvous (``MASTER_PORT``, ...) in the environment; restored after every test, so no later test's job or launcher
    joins a port that another job may hold by then."""
    from tests.helpers.jobs import LAUNCH_VARIABLES

    before = {name: os.environ.get(name) for name in LAUNCH_VARIABLES}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A tiny pretrained Llama directory (3 safetensors files, a 66 000-token BPE tokenizer trained offline) and the
    text its tokenizer was trained on; built once per test session."""
    from tests.helpers.hf_model_dir import make_model_dir, synthetic_text

    text = synthetic_text(120_000)
    return make_model_dir(tmp_path_factory.mktemp("hf_model") / "tiny-llama", text), text
