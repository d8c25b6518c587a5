"""The trainer's own errors (each message names the flag or key and the fix)."""


class ConfigMismatch(ValueError):
    """A flag that contradicts what the config sets explicitly."""


class NoPlanFits(ValueError):
    """--micro-batch auto found no plan whose step fits both the device and the host memory."""
