"""One rank's error ends every rank within seconds, with that rank's message.

A rank that fails outside a collective (an empty corpus, a read-only disk, a bad checkpoint) leaves its peers
waiting: in a collective until the process group's timeout (minutes; NCCL notices a dead peer only then), or in a
wait of their own (the token cache's writer). So a rank that fails counts its failure in the process group's store
with its message (:meth:`FailureWatch.report`, from the strategy's ``on_exception``), and every rank watches that
count from a daemon thread: when it grows, the rank is given a moment to fail by itself (most refusals are raised on
every rank at once, each with its own message), then it logs whose error stopped the job and exits. The store is the
one ``init_process_group`` made: no extra connection, nothing read from a device.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any, Optional

from lightning_seqpar._compat import default_store

log = logging.getLogger(__name__)

COUNT_KEY = "lightning_seqpar/failures"
MESSAGE_KEY = "lightning_seqpar/failure"
POLL_S = 0.5
"""Seconds between two reads of the store by one rank, up to 256 ranks; proportionally longer beyond (the store is
served by one process: about 512 reads/s whatever the job's size)."""
GRACE_S = 3.0
"""How long a rank that learns of another's failure waits to fail by itself (with its own message) before exiting."""


class FailureWatch:
    """This rank's watch over the other ranks' failures, from the moment it is made (a failure reported earlier, by
    an earlier run in the same processes, is not this run's).

    Args:
        rank: this process's global rank.
        world_size: the number of ranks (sets how often the store is read).
        store: the process group's store (default: the default group's; ``None`` without a process group: nothing
            is watched or reported).
    """

    def __init__(self, rank: int, world_size: int = 1, store: Any = None) -> None:
        self.rank, self.store = rank, store if store is not None else default_store()
        self.poll_s = POLL_S * max(1.0, world_size / 256)
        self.armed = self.store is not None
        self.armed_at = self._count() if self.armed else 0
        if self.armed:
            threading.Thread(target=self._watch, name="lightning_seqpar-failure-watch", daemon=True).start()

    def stop(self) -> None:
        """Stop watching (the run is over; a later run in this process makes its own watch)."""
        self.armed = False

    def _count(self) -> int:
        return int(self.store.add(COUNT_KEY, 0))

    def report(self, exception: BaseException) -> None:
        """Tell every rank this one failed, with ``exception``'s message; stop watching (this rank is ending)."""
        self.armed = False
        if self.store is None:
            return
        try:
            number = int(self.store.add(COUNT_KEY, 1))
            self.store.set(f"{MESSAGE_KEY}/{number}", f"rank {self.rank}: {type(exception).__name__}: {exception}"[:2000])
        except Exception:  # noqa: BLE001 - the store is gone (its host ended): the peers notice that themselves
            pass

    def _watch(self) -> None:
        while self.armed:
            try:
                failed = self._count() > self.armed_at
                message = self.store.get(f"{MESSAGE_KEY}/{self.armed_at + 1}").decode() if failed else None
            except Exception:  # noqa: BLE001 - the store closed: the run is over
                return
            if message is not None:
                deadline = time.monotonic() + GRACE_S
                while self.armed and time.monotonic() < deadline:
                    time.sleep(0.05)
                if self.armed:
                    log.error(f"[rank {self.rank}] stopping: {message}")
                    for handler in logging.getLogger().handlers:
                        handler.flush()
                    sys.stderr.flush()
                    os._exit(1)
                return
            time.sleep(self.poll_s)


def report_failure(watch: Optional[FailureWatch], exception: BaseException) -> None:
    """``watch.report(exception)`` when there is a watch."""
    if watch is not None:
        watch.report(exception)
