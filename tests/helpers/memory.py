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
