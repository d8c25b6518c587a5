"""Moved to `zerojax.engine.init_state`; this name keeps working for one release, with a DeprecationWarning."""
from zerojax._moved import forward

__getattr__ = forward(__name__, "zerojax.engine.init_state")
