"""Run a recipe or a command as a user would (a separate job, popen launch), and watch its processes.

Every job run through :func:`run_job` is also checked for a clean exit: no abort in interpreter teardown
("terminate called ..."), whatever its exit code. With every recipe run of the suite checked so, the dedicated
repetition of short jobs (``tests/lightning/test_clean_exit.py``) needs only a few runs of its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


ABORT = "terminate called"
"""What a C++ abort in interpreter teardown prints (a gloo group destroyed twice, a thread still running)."""

LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK",
                    "GROUP_RANK")
"""Left in the test process's environment by a test that ran a launcher in it (Lightning's spawn launcher sets the
rendezvous there): a job started after it must pick its own, so no job inherits them, whatever ran before."""


def run_job(args: list, cwd: Path, timeout: float = 400, check: bool = True, drop: tuple[str, ...] = (),
            **env: str) -> subprocess.CompletedProcess:
    """Run ``args`` in ``cwd`` with this checkout importable (``PYTHONPATH``), ``env`` added and the variables ``drop``
    and :data:`LAUNCH_VARIABLES` removed; the job must not abort in teardown, and with ``check`` must exit 0 (its
    output's tail is the failure message)."""
    environment = job_environment(drop)
    result = subprocess.run([str(a) for a in args], cwd=cwd, env={**environment, "PYTHONPATH": str(ROOT), **env},
                            capture_output=True, text=True, timeout=timeout)
    output = result.stdout + result.stderr
    assert ABORT not in output, f"the job aborted in teardown:\n{output[-3000:]}"
    if check:
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def job_environment(drop: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment for a new job: without ``drop`` and :data:`LAUNCH_VARIABLES`."""
    return {k: v for k, v in os.environ.items() if k not in drop and k not in LAUNCH_VARIABLES}


def start_recipe(tmp_path: Path, *overrides: str) -> tuple[subprocess.Popen, Path]:
    """Start ``recipes/pretrain_gpt.py`` in its own session; its output goes to ``tmp_path/job.log``."""
    log = tmp_path / "job.log"
    cmd = [sys.executable, str(ROOT / "recipes" / "pretrain_gpt.py"), f"hydra.run.dir={tmp_path / 'out'}", *overrides]
    env = {**job_environment(), "PYTHONPATH": str(ROOT)}
    with open(log, "w") as out:
        job = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    job.started = time.time()  # type: ignore[attr-defined]
    return job, log


def wait_for(log: Path, text: str, job: subprocess.Popen, timeout: float = 180) -> None:
    """Wait until ``text`` appears in the job's output; fail if the job ends first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if text in log.read_text():
            return
        if job.poll() is not None:
            raise AssertionError(f"the job ended (rc={job.returncode}) before printing {text!r}:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"no {text!r} after {timeout} s:\n{log.read_text()[-3000:]}")


def children(pid: int) -> list[int]:
    """Processes started by ``pid`` (Linux)."""
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def kill_session(job: subprocess.Popen) -> None:
    """Kill whatever the job left behind."""
    try:
        os.killpg(job.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    job.wait()
