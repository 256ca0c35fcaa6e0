"""A stalled or killed rank ends the job within the configured timeout, with a message, leaving nothing behind."""

import os
import signal
import time

import pytest

from tests.helpers.jobs import alive, children, kill_session, start_recipe, wait_for

pytestmark = pytest.mark.distributed

# Each bound below is what a loaded machine (another test's job beside this one on 2 cores) stays under, and far below
# what the fault it catches takes: a rank that waits out torch's default 30 minutes, or the recipe's 300 s stall timeout.
TIMEOUT = 8  # strategy.launch.timeout, seconds
MARGIN = 40  # seconds allowed beyond it: the failing rank's teardown and Python's exit (about 15 s on an idle machine)


ASYNC_SAVES = ("strategy.checkpointing.async_save=true", "trainer.val_check_interval=1")  # a background save every step


@pytest.mark.parametrize("fault, extra", [("SIGSTOP", ()), ("SIGKILL", ()), ("SIGSTOP", ASYNC_SAVES)],
                         ids=["SIGSTOP", "SIGKILL", "SIGSTOP-async-saves"])
def test_a_stalled_or_killed_rank_ends_the_job_within_the_timeout(tmp_path, fault, extra):
    """With saves in the background, the stalled rank may hold up the save's own group (it waited torch's default
    30 minutes before every group took the strategy's timeout)."""
    job, log = start_recipe(tmp_path, "model=gpt_tiny", f"strategy.launch.timeout={TIMEOUT}",
                            "trainer.max_steps=100000", "trainer.enable_progress_bar=false", *extra)
    try:
        wait_for(log, "All distributed processes registered", job)
        time.sleep(3)  # into setup or training: any collective waiting on the peer must give up
        (rank1,) = children(job.pid)
        stopped = time.time()
        os.kill(rank1, getattr(signal, fault))
        job.wait(timeout=TIMEOUT + MARGIN + 60)
        ended = time.time() - stopped
        output = log.read_text()
        print(f"{fault}: the job ended {ended:.1f} s after rank 1 was signalled, rc={job.returncode}")
        assert job.returncode != 0
        assert ended <= TIMEOUT + MARGIN, output[-3000:]
        assert not alive(rank1)  # a stopped rank is killed, not left behind
        if fault == "SIGSTOP":
            assert f"timed out after {TIMEOUT} s waiting for another rank" in output
            assert "torch.distributed." in output and "(called at " in output and "on process group '" in output
    finally:
        kill_session(job)


def test_ranks_end_with_a_launcher_that_dies(tmp_path):
    """The popen launcher (rank 0) killed outright: its other ranks are killed with it by the kernel, instead of
    waiting in a collective until the timeout."""
    job, log = start_recipe(tmp_path, "model=gpt_tiny", "strategy.launch.timeout=60", "trainer.max_steps=100000",
                            "trainer.enable_progress_bar=false")
    try:
        wait_for(log, "All distributed processes registered", job)
        (rank1,) = children(job.pid)
        os.kill(job.pid, signal.SIGKILL)
        killed = time.time()
        while alive(rank1) and time.time() - killed < 30:
            time.sleep(0.05)
        outlived = time.time() - killed
        print(f"rank 1 outlived the launcher by {outlived:.2f} s")
        assert not alive(rank1) and outlived < 0.5  # by itself (no fix) it noticed after 1.5-3 s
    finally:
        kill_session(job)


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_an_error_on_one_rank_ends_every_rank_within_seconds_with_its_message(tmp_path, failing_rank):
    """One rank fails while the other is in a long wait that is no collective (as ranks waiting for rank 0's token
    cache are): the other rank stops within seconds, saying whose error stopped it."""
    import subprocess
    import sys

    from tests.helpers.jobs import ROOT, job_environment

    start = time.time()
    job = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "failing_job.py"), str(failing_rank)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=180, env=job_environment())
    ended = time.time() - start
    output = job.stdout + job.stderr
    print(f"rank {failing_rank} failed: the job ended after {ended:.1f} s, rc={job.returncode}")
    assert job.returncode != 0 and f"the data of rank {failing_rank} cannot be read" in output
    assert f"[rank {1 - failing_rank}] stopping: rank {failing_rank}: RuntimeError: the data of rank" in output, output
    assert ended <= 90, output[-3000:]  # about 20 s on an idle machine; 120 s where the other rank sleeps it out


def test_an_empty_corpus_found_by_rank_0_ends_the_job_within_seconds(tmp_path):
    """The reproduction: rank 0 finds the corpus empty while tokenizing; rank 1, waiting for the token cache (outside
    any collective), waited out its 300 s stall timeout and then blamed a writer that "stalled or died"."""
    (tmp_path / "empty.txt").write_text("")
    start = time.time()
    job, log = start_recipe(tmp_path, "model=gpt_tiny", f"data.path={tmp_path / 'empty.txt'}",
                            "trainer.enable_progress_bar=false")
    try:
        job.wait(timeout=180)
        ended = time.time() - start
        output = log.read_text()
        print(f"empty corpus: the job ended {ended:.1f} s after it started, rc={job.returncode}")
        assert job.returncode != 0 and "holds no text" in output
        assert "[rank 1] stopping: rank 0: ValueError: The corpus at" in output, output[-3000:]
        assert "stalled or died" not in output and ended <= 120, output[-3000:]  # the stall timeout: 300 s
    finally:
        kill_session(job)


@pytest.mark.parametrize("during", ["a step", "a save"])
def test_sigterm_saves_a_checkpoint_and_ends_every_rank_cleanly(tmp_path, during):
    """Preemption: SIGTERM to the job (the launcher, rank 0) while it trains, or while it saves every step in the
    background; every rank stops after the same step, saves last.ckpt together and exits 0, within seconds."""
    import subprocess
    import sys

    from tests.helpers.jobs import ROOT

    saves = ["strategy.checkpointing.async_save=true", "trainer.val_check_interval=1"] if during == "a save" else []
    # a rank left behind would wait out the strategy's 300 s timeout
    job, log = start_recipe(tmp_path, "model=gpt_tiny", "strategy.launch.timeout=300", "trainer.max_steps=100000",
                            "trainer.enable_progress_bar=false", *saves)
    try:
        # The layout line ends the fit's start (the planner's probes price the memory): preemption is handled from
        # the first training step on, and a signal before it ends the job like any signal before training.
        wait_for(log, "layout: ", job)
        time.sleep(8)  # well into training
        signalled = time.time()
        os.kill(job.pid, signal.SIGTERM)
        job.wait(timeout=180)
        ended = time.time() - signalled
        output = log.read_text()
        print(f"SIGTERM during {during}: the job ended {ended:.1f} s later, rc={job.returncode}")
        assert job.returncode == 0, output[-3000:]
        assert ended <= 90, output[-3000:]  # 15-20 s on an idle machine, 34 s beside another job
        assert "Preempted (signal 15): stopped after step" in output
        checkpoint = tmp_path / "out" / "checkpoints" / "last.ckpt"
        verify = subprocess.run([sys.executable, "-m", "lightning_seqpar.checkpoint", "verify", str(checkpoint)],
                                cwd=ROOT, capture_output=True, text=True)
        assert verify.returncode == 0, verify.stdout + verify.stderr
        step = int(output.split("stopped after step ")[1].split(",")[0])
        assert f"step {step}" in output and not [p for p in (tmp_path / "out" / "checkpoints").iterdir()
                                                 if p.name.startswith(".")]  # nothing half-written left
        # One save of the stop, inside the scheduler's grace period: not last.ckpt and then last-v1.ckpt again.
        assert not [p.name for p in (tmp_path / "out" / "checkpoints").iterdir() if p.name.startswith("last-v")]
    finally:
        kill_session(job)

