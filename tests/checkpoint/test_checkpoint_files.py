"""Checkpoint folder housekeeping (zerojax.checkpoint.files) on a folder laid out as
zerojax.checkpoint.state writes it: what orbax calls temporary is cleaned, pruning keeps the newest N
(Hugging Face's save_total_limit semantics) and never the tag `latest` names."""
import os

import pytest

from zerojax.checkpoint import files as checkpoint_files


def _tag(root, name, mtime):
    (root / name / "meta").mkdir(parents=True)
    os.utime(root / name, (mtime, mtime))


def test_prune_keeps_newest_and_latest(tmp_path):
    for i, name in enumerate(["global_step10", "global_step20", "global_step30", "global_step40"]):
        _tag(tmp_path, name, 1_000_000 + i)
    (tmp_path / "latest").write_text("global_step10")  # e.g. a run resumed from an older tag
    removed = checkpoint_files.prune(tmp_path, keep=2)
    assert sorted(os.path.basename(p) for p in removed) == ["global_step20"]
    assert checkpoint_files.finalized_tags(tmp_path) == ["global_step10", "global_step30", "global_step40"]
    with pytest.raises(ValueError, match="keep=0: .* must be an int >= 1"):
        checkpoint_files.prune(tmp_path, keep=0)


def test_interrupted_save_found_and_removed_finalized_untouched(tmp_path):
    _tag(tmp_path, "global_step10", 1_000_000)
    (tmp_path / "latest").write_text("global_step10")
    (tmp_path / "global_step20.orbax-checkpoint-tmp" / "meta").mkdir(parents=True)
    (tmp_path / ".latest.tmp4242").write_text("global_step20")  # killed between write and rename
    found = checkpoint_files.remove_interrupted_saves(tmp_path)
    assert [os.path.basename(p) for p in found] == [".latest.tmp4242", "global_step20.orbax-checkpoint-tmp"]
    assert sorted(os.listdir(tmp_path)) == ["global_step10", "latest"]
    assert checkpoint_files.interrupted_saves(tmp_path) == []
    assert checkpoint_files.interrupted_saves(tmp_path / "no") == []
