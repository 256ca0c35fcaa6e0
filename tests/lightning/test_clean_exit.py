"""A successful run exits 0, every time: no abort in interpreter teardown (popen launch, the default).

Every recipe job of the suite is checked for the same abort (:func:`tests.helpers.jobs.run_job`: the recipes' jobs of
two to four processes, refused ones included); these short jobs repeat the smallest one on top of them."""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.jobs import ABORT, ROOT, job_environment

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

RUNS = 4


def _run(_):
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "short_job.py")], capture_output=True,
                            text=True, timeout=300, cwd=ROOT, env=job_environment())
    return result.returncode, result.stdout + result.stderr


def test_short_runs_all_exit_0_without_an_abort():
    with ThreadPoolExecutor(2) as pool:  # two jobs at a time: 4 processes on the 2 cores
        results = list(pool.map(_run, range(RUNS)))
    failures = [(rc, out[-2000:]) for rc, out in results if rc != 0 or ABORT in out]
    assert failures == []
    assert all(out.count("done") == 2 for _, out in results)  # both ranks finished their work
