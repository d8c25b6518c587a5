"""How a `zerojax` command ends on a problem: a user's mistake (a flag's value, a file, a config, a
checkpoint, a model or a cache that does not fit) as one `error: ...` line on stderr and exit status
1; Ctrl-C outside the training loop (which saves first: its own handler) as one line and status 130,
the shell's for SIGINT; no traceback. `--debug` (anywhere on the command line) shows the traceback
instead. Any other exception is a bug and keeps its traceback: that is what a report needs.

argparse's own usage errors keep its status 2 and its usage lines, ending in the `error:` line.
"""
from __future__ import annotations

import sys
from collections.abc import Callable

DEBUG_FLAG = "--debug"

# zerojax's errors that are not ValueError / OSError, by where they live: looked up only among the
# modules already imported (an error of a module never imported was never raised), so telling a
# mistake from a bug imports nothing (`zerojax estimate` picks its backend before jax is imported)
_USER_ERRORS = ("zerojax.checkpoint.errors.CheckpointError", "zerojax.generation.cache.CacheTooLargeError",
                "zerojax.engine.memory.WillNotFitError", "zerojax.engine.memory.HeldMemoryError",
                "zerojax.engine.monitor.MonitorError")


def split_debug(argv) -> tuple[list[str], bool]:
    """argv without its --debug flags, and whether it had one."""
    rest = [a for a in argv if a != DEBUG_FLAG]
    return rest, len(rest) != len(argv)


def is_user_error(error: BaseException) -> bool:
    """A mistake the user can fix from the message alone: a ValueError (zerojax's ConfigError,
    DataError, ... among them), an OSError (a missing file, a folder without permission), a
    non-finite number (FloatingPointError), or one of zerojax's own errors (`_USER_ERRORS`)."""
    if isinstance(error, (ValueError, OSError, FloatingPointError)):
        return True
    for path in _USER_ERRORS:
        module, _, name = path.rpartition(".")
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(error, cls):
            return True
    return False


def error_line(error: BaseException) -> str:
    """The `error: ...` text of a user's mistake (its message; the type where it has none)."""
    return f"error: {str(error).strip() or type(error).__name__}"


def run_command(command: Callable[[], int | None], debug: bool = False) -> int:
    """command() -> its exit status; a user's mistake prints its `error:` line on stderr -> 1,
    Ctrl-C one line -> 130; with `debug`, both propagate as they are (the traceback)."""
    try:
        return int(command() or 0)
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted (Ctrl-C); --debug shows where", file=sys.stderr, flush=True)
        return 130
    except Exception as e:  # noqa: BLE001 - sorted into the user's mistakes and bugs just below
        if debug or not is_user_error(e):
            raise
        print(error_line(e), file=sys.stderr, flush=True)
        return 1
