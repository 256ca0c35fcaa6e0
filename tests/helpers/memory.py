"""This process's resident memory, for peak-growth measurements in spawned workers."""


def resident_kib() -> int:
    """Resident size now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4


def peak_resident_kib() -> int:
    """Peak resident size since the process started (VmHWM). Not ``ru_maxrss``: Linux carries that over ``exec``
    from the forked parent, so a spawned worker would report the test runner's own peak when it is higher."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


def reset_peak_resident() -> None:
    """Start a new peak (VmHWM := resident now), Linux's ``clear_refs`` 5."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def anonymous_bytes() -> int:
    """This process's anonymous resident memory (``RssAnon``): its own heap, not the page cache a memory-mapped
    file's pages belong to (those are shared by every process mapping the file and dropped under pressure)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon:")) * 1024


class AnonymousPeak:
    """Peak growth of :func:`anonymous_bytes` inside a ``with`` block, sampled every millisecond by a thread."""

    def __enter__(self) -> "AnonymousPeak":
        import threading

        self.start = self.peak = anonymous_bytes()
        self._done = threading.Event()

        def sample() -> None:
            while not self._done.wait(0.001):
                self.peak = max(self.peak, anonymous_bytes())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, anonymous_bytes())

    @property
    def growth(self) -> int:
        """Bytes above the start, at the peak."""
        return self.peak - self.start
