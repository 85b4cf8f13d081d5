"""A wall-clock bound for one call, for tests of inputs that once took minutes or hung."""

import contextlib
import signal


class Overtime(Exception):
    pass


@contextlib.contextmanager
def within(seconds: float, what: str = ""):
    """Raise Overtime if the block runs longer than `seconds` (main thread, POSIX only)."""
    def alarm(signum, frame):
        raise Overtime(f"{what or 'call'} took longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    # Repeats: Python drops an exception raised in __del__, so one alarm can be lost.
    signal.setitimer(signal.ITIMER_REAL, seconds, 0.1)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
