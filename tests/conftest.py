"""Tests by concept: ``tests/<folder>`` mirrors ``lightning_seqpar/<folder>`` (plus ``package/`` for the package's
structure and versions, ``recipes/`` for the recipes). A test module that starts processes (gloo on CPU) says so with
``pytestmark = pytest.mark.distributed``, and a single-process test of many seconds (the planner's probes) is marked
``slow``, so ``python -m pytest -m "not distributed and not slow"`` is the fast single-process lane;
a module that uses the multi-process helpers without the mark is refused at collection.

The suite runs on two test workers (pytest-xdist, ``-n 2 --dist loadfile`` in ``setup.cfg``; ``-n 0`` runs it in one
process): each file runs whole on one worker, so a module's shared worlds are built once. Files are handed out longest
first, by the seconds each took in a recorded run (``tests/durations.json``; a file not in it goes last): a long file
handed out late would run alone at the end. ``python -m pytest --store-durations`` records them again.

A wall-clock bound in a test holds beside another test's job on 2 cores and stays far below what the fault it catches
takes (a rank that waits out a default timeout of minutes): no test needs the machine to itself.
"""

import json
import os
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest

_STARTS_PROCESSES = ("run_distributed", "run_cases", "start_recipe")  # the multi-process helpers
DURATIONS = Path(__file__).parent / "durations.json"  # seconds per test file, relative to the repository


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--store-durations", action="store_true",
                     help=f"write the seconds each test file took (setup, call, teardown) to {DURATIONS}")


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
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    # Stable: a file's tests keep their order. Every worker collects the same order (xdist checks it) and hands out
    # files in it (--no-loadscope-reorder).
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0.0))


class _FileDurations:
    """Seconds per test file (setup, call and teardown of its tests), written to :data:`DURATIONS` at the end. On the
    controller, which receives every worker's reports."""

    def __init__(self) -> None:
        self.took: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.took[report.nodeid.split("::")[0]] += report.duration

    def pytest_sessionfinish(self) -> None:
        DURATIONS.write_text(json.dumps({f: round(t, 1) for f, t in sorted(self.took.items())}, indent=0) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("store_durations") and not hasattr(config, "workerinput"):  # a worker has workerinput
        config.pluginmanager.register(_FileDurations(), "file-durations")
    # the planner's command line keeps its probes' fits on disk: in the run's own directory, not the user's cache
    cache = tempfile.mkdtemp(prefix="lightning_seqpar_cache_")
    os.environ["LIGHTNING_SEQPAR_CACHE"] = cache
    config.add_cleanup(lambda: shutil.rmtree(cache, ignore_errors=True))


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


@pytest.fixture(autouse=True)
def _process_group_restored():
    """A Trainer run in this process on one device (the strategy's world of one) leaves torch's default process group
    initialized, as Lightning's own strategies do (they destroy it at exit); destroyed after the test that made it, so
    no later test in this process finds a group it did not make (which tests share a worker is the scheduler's
    choice: a test asserting that a refused Trainer initialized nothing failed after such a run)."""
    import torch.distributed as dist

    before = dist.is_available() and dist.is_initialized()
    yield
    if not before and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A tiny pretrained Llama directory (3 safetensors files, a 66 000-token BPE tokenizer trained offline) and the
    text its tokenizer was trained on; built once per test session."""
    from tests.helpers.hf_model_dir import make_model_dir, synthetic_text

    text = synthetic_text(120_000)
    return make_model_dir(tmp_path_factory.mktemp("hf_model") / "tiny-llama", text), text
