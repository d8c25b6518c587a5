"""The planner refuses a plan whose compiled step holds more host memory than is available (an
offloaded optimizer state, offload_param's gradient accumulator): it would otherwise die of host
OOM minutes into building. CPU compiles report no host bytes, so the compiled memory is given:
what the real compile reports (device peak) with a host figure that grows with accumulation,
as offload_param's fp32 accumulator does."""
import dataclasses

import pytest

from tiny_gpt2 import tiny_gpt2 as factory
from zerojax.planning import planner as PL

pytestmark = pytest.mark.slow  # compiles the planner's candidates

SEQ = 32
CFG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
       "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "zero_optimization": {"stage": 2}}
STATES, ACCUMULATOR = 1000, 400  # host bytes: the offloaded states; the accumulator when accumulating


def test_a_plan_over_host_memory_is_not_chosen(monkeypatch):
    real = PL.step_memory
    seen = []

    def with_host(model_factory, cfg_dict, seq_len, micro_batch, *, grad_accum=None, **kw):
        m = real(model_factory, cfg_dict, seq_len, micro_batch, grad_accum=grad_accum, **kw)
        seen.append((micro_batch, grad_accum))
        return dataclasses.replace(m, host_argument=STATES + (ACCUMULATOR if (grad_accum or 1) > 1 else 0))

    monkeypatch.setattr(PL, "step_memory", with_host)
    budget = 2**40  # every choice fits the device
    # room for the states but not the accumulator: only micro-batch 4 x 1 (no accumulation) fits
    found = PL.search(factory, CFG, budget, SEQ, stages=(2,), offloads=("optimizer",), remat=("full",),
                      max_plans=3, host_budget=STATES + ACCUMULATOR // 2, one_per_tier=False)
    assert [(p.micro_batch, p.grad_accum) for p in found.plans] == [(4, 1)]
    outcomes = {(p.micro_batch, p.grad_accum): o for p, o in found.tried}
    assert outcomes[(4, 1)] == "fits"
    over = [o for (m, a), o in outcomes.items() if a > 1]
    assert over and all(o.startswith("does not fit host memory") for o in over)
    # the same search with room for the accumulator keeps the accumulating plans
    found = PL.search(factory, CFG, budget, SEQ, stages=(2,), offloads=("optimizer",), remat=("full",),
                      max_plans=3, host_budget=STATES + ACCUMULATOR, one_per_tier=False)
    assert len(found.plans) == 3 and any(p.grad_accum > 1 for p in found.plans)
