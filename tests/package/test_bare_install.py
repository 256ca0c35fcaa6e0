"""The README's first command on a bare install: ``recipes/pretrain_gpt.py`` with its default configuration trains,
validates, checkpoints and samples with none of the optional extras importable, in the launching process and in every
rank it starts."""

import re
import sys

import pytest

from lightning_seqpar.extras import EXTRAS
from tests.helpers.jobs import ROOT, run_job

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

OPTIONAL = sorted({name for modules in EXTRAS.values() for name in modules})  # transformers, peft, tokenizers, ...

BLOCKER = """\
import sys
from importlib import metadata

BARE = {names!r}
for name in BARE:
    sys.modules[name] = None  # `import name` raises ModuleNotFoundError, as where it was never installed

_from_name = metadata.Distribution.from_name.__func__


def _installed_only(cls, name):
    # Libraries ask the installed distributions before importing (torchmetrics imports transformers when its
    # metadata says >= 4.4): a bare install has no metadata for them either.
    if name.lower().replace("_", "-") in BARE:
        raise metadata.PackageNotFoundError(name)
    return _from_name(cls, name)


metadata.Distribution.from_name = classmethod(_installed_only)
"""


def test_the_default_main_job_runs_with_every_optional_extra_unimportable(tmp_path):
    # Python imports `sitecustomize` from PYTHONPATH at start-up: every process of the job, ranks included, is bare.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER.format(names=OPTIONAL))
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "recipes" / "pretrain_gpt.py"), "trainer.max_steps=2",
           "trainer.val_check_interval=2", "trainer.log_every_n_steps=1", "trainer.limit_val_batches=2",
           "sample.max_new_tokens=16", f"hydra.run.dir={out}"]
    result = run_job(cmd, tmp_path, timeout=300, PYTHONPATH=f"{site}:{ROOT}")
    output = result.stdout + result.stderr
    assert "--- sample ---" in result.stdout and "val/loss" in result.stdout
    assert "Epoch 0" in output and "/-2" not in output  # the progress bar of a step-based run
    assert "sync_dist=True" not in output  # no Lightning warning caused by the reference module
    assert "whole model" in output and "Total FLOPs" not in output  # the whole model's parameter count
    # The layout is reported; where the prediction needs transformers, one line names the extra instead.
    layout = next(line for line in output.splitlines() if re.search(r"layout: Layout\(tp=2[^)]*\) dp=1", line))
    assert "no predicted peak" in layout and "[hf] extra" in layout and "pip install" in layout
    assert "Traceback" not in output
    assert (out / "checkpoints" / "last.ckpt").exists()
    metrics = next((out / "logs").rglob("metrics.csv")).read_text()
    assert "train/loss" in metrics.splitlines()[0] and "perf/tokens_per_s" in metrics.splitlines()[0]
