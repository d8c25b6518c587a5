"""The engine's public surface stays small: what it was built with (cfg, mesh, options), its state
and running (steps, checkpoints, memory), the model's views; everything else static about it is
read through `engine.layout`. The layout fields it once passed through still answer for one
release, each with a DeprecationWarning naming the new spelling and the layout's own value."""
import pytest
from flax import nnx
from tiny_mlp import MLP, loss_fn  # tests/ is on sys.path under pytest

from zerojax.engine.engine import LAYOUT_FIELDS, abstract_engine

MAX_PUBLIC = 30


@pytest.fixture(scope="module")
def engine():
    # abstract: the layout and a state of ShapeDtypeStructs, nothing compiled or allocated
    cfg = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2}}
    return abstract_engine(lambda: MLP(nnx.Rngs(0)), cfg, loss_fn=loss_fn)


def test_at_most_30_public_members(engine):
    public = sorted(n for n in dir(engine) if not n.startswith("_"))
    assert "layout" in public and "state" in public and "train_step" in public
    assert len(public) <= MAX_PUBLIC, f"{len(public)} public members: {public}"
    assert not set(public) & set(LAYOUT_FIELDS), "a deprecated pass-through is public again"


def test_old_layout_names_warn_and_read_the_layout(engine):
    for old, new in LAYOUT_FIELDS.items():
        with pytest.warns(DeprecationWarning, match=rf"Engine\.{old} is deprecated.*engine\.layout\.{new}"):
            value = getattr(engine, old)
        assert value == getattr(engine.layout, new), old  # (state_shardings: a property, built per read)
    assert engine.layout.stage == 2  # the config's stage, read the new way
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        engine.no_such_name  # noqa: B018 - the lookup is the test
