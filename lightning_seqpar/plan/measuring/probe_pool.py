"""The probes of a fit measured in worker processes at once: a question's first answer in seconds, not minutes.

A fit needs thirteen probes (:data:`~.probe._PROBES`), each a small model built, rewritten and run forward by Python
(about a tenth of a second, nearly all of it the interpreter's): threads would take turns on one interpreter lock, so
the probes of a fit go to ``workers`` processes, each started once (``spawn``: a clean interpreter, safe beside
torch's own threads and any CUDA context of the caller) and kept for the whole question. Probe ``i`` of every fit
goes to worker ``i mod workers``, so each worker keeps the small models of its own probes
(:class:`~.probe_models.ProbeModels`, one per worker process, made by its initializer) and copies them for the next
layout instead of building them again. Each worker runs torch on one thread: the probes' tensors are tiny, and the
processes, not the threads, use the cores.

The pool is the caller's to open and close (:func:`probe_pool`), around every :func:`~..planner.plan` call of one
question; the probes' cache (``fits``) carries it to the fits, under :data:`KEY`.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, Callable, Iterator, MutableMapping, Optional

KEY = ("probe pool",)
"""Where :func:`probe_pool` puts the pool in the probes' cache."""

_models: Any = None  # the worker process's own ProbeModels (made by _start_worker; never set in the caller)


def _start_worker() -> None:
    global _models
    import torch

    from lightning_seqpar.plan.measuring.probe_models import ProbeModels

    torch.set_num_threads(1)
    _models = ProbeModels()


def _measure(function: Callable[..., Any], arguments: tuple) -> Any:
    return function(*arguments, models=_models)


class ProbePool:
    """``workers`` processes measuring probes (:func:`~.probe.measure`), each started on first use.

    Args:
        workers: how many processes (at least 1).

    Raises:
        ValueError: ``workers`` below 1.
    """

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers}: at least 1 (or no pool: the probes measured in this process).")
        self.workers = workers
        self._executors: list[Optional[ProcessPoolExecutor]] = [None] * workers

    def _executor(self, index: int) -> ProcessPoolExecutor:
        slot = index % self.workers
        if self._executors[slot] is None:
            self._executors[slot] = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                        initializer=_start_worker)
        return self._executors[slot]  # type: ignore[return-value]

    def measure(self, function: Callable[..., Any], calls: list[tuple[int, tuple]]) -> list[Any]:
        """``function(*arguments, models=...)`` for each ``(probe index, arguments)`` of ``calls`` (the index choosing
        the worker; ``models``: the worker's :class:`~.probe_models.ProbeModels`), the results in the order of
        ``calls``. ``function``: :func:`~.probe.measure` (sent by name: a module-level function).

        Raises:
            what ``function`` raised in a worker (the first, in the order of ``calls``).
        """
        futures: list[Future] = [self._executor(index).submit(_measure, function, arguments)
                                 for index, arguments in calls]
        return [future.result() for future in futures]

    def close(self) -> None:
        """Stop the workers (a started probe finishes first)."""
        for executor in self._executors:
            if executor is not None:
                executor.shutdown(wait=True, cancel_futures=True)
        self._executors = [None] * self.workers


def default_workers(most: int) -> int:
    """The cores this process may run on, at most ``most`` (a fit's probes, :data:`~.probe.PROBES_PER_FIT`: more
    workers would wait): what :func:`probe_pool` starts."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, most))


@contextlib.contextmanager
def probe_pool(fits: MutableMapping, workers: Optional[int], most: int) -> Iterator[Optional[ProbePool]]:
    """Within the block, the fits of ``fits`` (the probes' cache handed to :func:`~..planner.plan`) measure their
    missing probes on ``workers`` processes (``None``: :func:`default_workers` of ``most``); one worker: in this
    process. The workers stop when the block ends, and the pool leaves ``fits``."""
    count = default_workers(most) if workers is None else workers
    if count <= 1:
        yield None
        return
    pool = ProbePool(count)
    fits[KEY] = pool
    try:
        yield pool
    finally:
        del fits[KEY]
        pool.close()
