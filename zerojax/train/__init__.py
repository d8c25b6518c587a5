"""Moved to `zerojax.engine` (the runtime: layout, step, memory guard, engine), apart from the
`zerojax.trainer` program; `zerojax.train.*` keeps working for one release, with a DeprecationWarning."""
from zerojax._moved import forward

__getattr__ = forward(__name__, "zerojax.engine")
