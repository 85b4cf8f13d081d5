"""A bound on one call's CPU time (this process's), for tests of inputs that once took minutes
or hung: what it allows is the same on a busy machine as on a quiet one. A call that blocks
(a FIFO opened for reading) uses no CPU: a wall-clock backstop many times longer ends it."""

import contextlib
import signal


class Overtime(Exception):
    pass


@contextlib.contextmanager
def within(seconds: float, what: str = ""):
    """Raise Overtime if the block takes more than `seconds` of CPU time, or blocks for
    BACKSTOP times that (main thread, POSIX only)."""
    def overtime(signum, frame):
        if signum == signal.SIGPROF:
            raise Overtime(f"{what or 'call'} took more than {seconds} s of CPU time")
        raise Overtime(f"{what or 'call'} blocked for {BACKSTOP * seconds} s")

    previous = [signal.signal(s, overtime) for s in (signal.SIGPROF, signal.SIGALRM)]
    # Repeats: Python drops an exception raised in __del__, so one alarm can be lost.
    signal.setitimer(signal.ITIMER_PROF, seconds, 0.1)
    signal.setitimer(signal.ITIMER_REAL, BACKSTOP * seconds, 0.1)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        for s, handler in zip((signal.SIGPROF, signal.SIGALRM), previous, strict=True):
            signal.signal(s, handler)


BACKSTOP = 20  # a blocked call's wall clock, in multiples of the CPU bound
