"""The checkpoint package's errors (a leaf module: the tag rule and the folder lock raise them
without importing orbax)."""


class CheckpointError(RuntimeError):
    """A checkpoint that exists but cannot be read (corrupt, partial, or incompatible), or a
    checkpoint folder that cannot be written now (in use by another run, not enough space,
    non-finite state)."""


__all__ = ["CheckpointError"]
