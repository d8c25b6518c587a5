"""SIGTERM and Ctrl-C during training: finish the step, save, stop in one line.

A preempted cluster job gets SIGTERM and a grace period; the run used to die at once with no save
(and Ctrl-C printed a 53-line traceback). While the training loop runs, the first SIGTERM or SIGINT
only asks the loop to stop at the next step boundary; the trainer then saves a checkpoint (where it
has a --save folder) and exits 0 with one line. A second Ctrl-C stops at once (KeyboardInterrupt).

With several processes a signal may reach them at different steps; the loop then asks all of them
(`agreed`) each step, so that every process stops after the same step and joins the same save.
"""
from __future__ import annotations

import signal
import sys
import threading


class StopRequest:
    """The loop's stop flag, set by SIGTERM / SIGINT while `installed` (main thread only)."""

    def __init__(self):
        self.signal: str | None = None
        self._previous: dict = {}

    def install(self) -> "StopRequest":
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

    def agreed(self) -> bool:
        """Whether the loop stops after this step: this process's flag, or any process's."""
        import jax

        if jax.process_count() == 1:
            return self.signal is not None
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
