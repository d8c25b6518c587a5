"""--micro-batch auto with LoRA: the planner compiles the model it will run (the frozen base, the
adapters) and never offers parameter offload, which LoRA's layer scan cannot take."""
import jax
import numpy as np
import pytest
from flax import nnx
from test_example import TINY, _example

pytestmark = pytest.mark.slow  # plans and trains LoRA runs through the example


def test_lora_micro_batch_auto_plans_the_adapted_model_and_trains_as_the_chosen_plan(monkeypatch, capsys):
    from zerojax import lora
    from zerojax.planning import memory, planner

    example = _example()
    searches = []
    real = planner.search

    def recording(*args, **kw):
        found = real(*args, **kw)
        searches.append((args, kw, found))
        return found

    monkeypatch.setattr(planner, "search", recording)
    monkeypatch.setattr(memory, "device_budget", lambda device=None: 2**40)
    argv = ["--model", "tiny-llama", *TINY[2:], "--steps", "3", "--lora", "4"]
    planned = example.main([*argv, "--micro-batch", "auto"])
    (args, kw, found), = searches
    assert "param" not in kw["offloads"] and "none" in kw["offloads"]
    model = args[0]()  # the planner's factory builds the LoRA model itself
    assert lora.trainable_count(model) == planned["trained_params"]
    frozen = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, lora.FrozenWeight)))
    best = found.plans[0]
    assert best.peak_bytes >= frozen  # the frozen base is in the compiled step it measured
    assert f"micro-batch auto: {best.describe()}" in capsys.readouterr().out
    # the run is the plan's: the same losses as the same micro-batch given by hand
    monkeypatch.setattr(memory, "device_budget", lambda device=None: None)
    by_hand = example.main([*argv, "--micro-batch", str(best.micro_batch), "--grad-accum", str(best.grad_accum),
                            *(["--remat", best.remat or "none"])])
    np.testing.assert_allclose(planned["losses"], by_hand["losses"], rtol=1e-6)
