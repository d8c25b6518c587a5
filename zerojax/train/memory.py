"""Moved to `zerojax.engine.memory`; this name keeps working for one release, with a DeprecationWarning."""
from zerojax._moved import forward

__getattr__ = forward(__name__, "zerojax.engine.memory")
