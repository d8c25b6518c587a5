"""Moved to `zerojax.engine.step`; this name keeps working for one release, with a DeprecationWarning."""
from zerojax._moved import forward

__getattr__ = forward(__name__, "zerojax.engine.step")
