"""A progress bar over bytes of input while data is prepared (tokenized, rendered): rich's, on a terminal only; logs
say when the work is done."""

from __future__ import annotations

import sys
from typing import Callable


class ByteProgress:
    """``with ByteProgress(total, description, enabled) as advance: advance(n_bytes)``; a no-op off a terminal."""

    def __init__(self, total: int, description: str, enabled: bool = True) -> None:
        self.total, self.description, self.enabled = total, description, enabled
        self.bar = None

    def __enter__(self) -> Callable[[int], None]:
        if not (self.enabled and sys.stderr.isatty()):
            return lambda n: None
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                            TimeRemainingColumn(), transient=True)
        self.bar.start()
        task = self.bar.add_task(self.description, total=self.total)
        return lambda n: self.bar.advance(task, n)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()
