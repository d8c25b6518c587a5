"""Checkpoints: layout-free pytrees <-> orbax (`state`), tag folders and keep-N (`files`),
and layer-group streaming for state that never fits in host memory at once (`stream`)."""
from zerojax.checkpoint.state import CheckpointError, Restored, export, list_tags, read_meta, restore, save

__all__ = ["CheckpointError", "Restored", "save", "restore", "export", "read_meta", "list_tags"]
