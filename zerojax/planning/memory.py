"""The memory guard is `zerojax.engine.memory` (the engine runs it, so it sits below planning); this
path is that same module object, so reads and monkeypatches of either name agree."""
import sys

from zerojax.engine import memory

sys.modules[__name__] = memory
