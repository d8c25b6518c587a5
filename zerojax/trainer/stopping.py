"""SIGTERM and Ctrl-C during training: finish the step, save, stop in one line.

A preempted cluster job gets SIGTERM and a grace period; the run used to die at once with no save
(and Ctrl-C printed a 53-line traceback). While the training loop runs, the first SIGTERM or SIGINT
only asks the loop to stop at the next step boundary; the trainer then saves a checkpoint (where it
has a --save folder) and exits 0 with one line. A second Ctrl-C stops at once (KeyboardInterrupt).

With several processes a signal may reach them at different steps; every `AGREE_EVERY` steps the loop
asks all of them (`agreed`), so that every process stops after the same step and joins the same save.
Not every step: the question is a collective the host waits for, which would take away the one step
the host runs ahead of the device (the trainer's log line every 10 steps waits for its loss anyway).
"""
from __future__ import annotations

import signal
import sys
import threading

AGREE_EVERY = 10  # steps between the processes' agreement on a stop (several processes only)


class StopRequest:
    """The loop's stop flag, set by SIGTERM / SIGINT while `installed` (main thread only)."""

    def __init__(self):
        self.signal: str | None = None
        self._previous: dict = {}

    def install(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum, frame):
        name = signal.Signals(signum).name
        if self.signal is not None and signum == signal.SIGINT:  # the second press: now
            self.uninstall()
            raise KeyboardInterrupt
        self.signal = self.signal or name
        print(f"{name}: stopping after this step" + (" (Ctrl-C again stops now)" if signum == signal.SIGINT else ""),
              file=sys.stderr, flush=True)

    def agreed(self, steps_done: int = 0) -> bool:
        """Whether the loop stops after this step (the run's `steps_done`-th): this process's flag; with
        several processes, any process's, asked every AGREE_EVERY steps."""
        import jax

        if jax.process_count() == 1:
            return self.signal is not None
        if steps_done % AGREE_EVERY:
            return False
        import numpy as np
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.asarray([self.signal is not None]))
        if flags.any() and self.signal is None:
            self.signal = "SIGTERM"  # another process's
        return bool(flags.any())

    def exit_status(self, saved: bool) -> int:
        """0 where a checkpoint holds the run (what a preempted job's scheduler expects), else 128 + signal."""
        if saved or self.signal is None:
            return 0
        return 128 + int(getattr(signal, self.signal))


__all__ = ["StopRequest"]
