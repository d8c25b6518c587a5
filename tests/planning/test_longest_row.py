"""The planner's longest row (`planner.longest_row`, behind `zerojax train --seq-len auto` and
`zerojax estimate --seq auto`): the length found fits the budget and the next granule does not,
checked against the step compiled directly (an abstract engine's own compile, not the planner's
memoised `step_memory`); the host budget ends it where the host runs out first; the search itself
(doubling, then bisection) against a threshold it cannot see."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from zerojax.config import load_config
from zerojax.engine import engine as E
from zerojax.engine import memory as M
from zerojax.models import Llama, LlamaConfig
from zerojax.models.llama import llama_loss
from zerojax.planning import planner as PL

CFG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
       "bf16": {"enabled": False}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "zero_optimization": {"stage": 2}}
GRANULE = 32  # short rows: a few compiles of a second each
BUDGET = 4_000_000  # bytes per device: a tiny Llama's step fits a few hundred tokens of it


def tiny_llama():
    return Llama(LlamaConfig.named("tiny"), rngs=nnx.Rngs(0), dtype=jnp.float32)


def compiled_peak(seq: int) -> int:
    """The reference: the engine's training step at `seq` compiled directly (the abstract engine
    any run builds, its step's XLA memory analysis), not through the planner."""
    cfg = load_config(CFG, world_size=jax.device_count())
    eng = E.abstract_engine(tiny_llama, cfg, loss_fn=llama_loss)
    batch = {"input_ids": jax.ShapeDtypeStruct((cfg.train_batch_size, seq), jnp.int32)}
    return M.CompiledMemory.of(eng.compiled_step(batch)).peak


@pytest.fixture(scope="module")
def found():
    return PL.longest_row(tiny_llama, CFG, BUDGET, granule=GRANULE, loss_fn=llama_loss, host_budget=2**40)


def test_the_row_found_fits_and_the_next_granule_does_not(found):
    L = found.seq_len
    assert L % GRANULE == 0 and L >= 2 * GRANULE  # not the trivial answer
    assert found.beyond == L + GRANULE
    assert compiled_peak(L) <= BUDGET < compiled_peak(L + GRANULE)
    assert (found.peak, found.beyond_peak) == (compiled_peak(L), compiled_peak(L + GRANULE))
    assert f"{L:,} tokens (a multiple of {GRANULE})" in found.describe()
    # doubling then bisection: a handful of compiles, not one a granule
    assert found.compiles <= 2 * (L // GRANULE).bit_length() + 1


def test_the_model_positions_cap_the_row_and_a_start_saves_the_doublings(found):
    capped = PL.longest_row(tiny_llama, CFG, BUDGET, granule=GRANULE, loss_fn=llama_loss, host_budget=2**40,
                            cap=found.seq_len - 1)
    assert capped.seq_len == found.seq_len - GRANULE and capped.beyond is None
    assert f"the model has {found.seq_len - 1:,} positions" in capped.describe()
    # a start above the answer halves down, then bisects: the same row
    above = PL.longest_row(tiny_llama, CFG, BUDGET, granule=GRANULE, loss_fn=llama_loss, host_budget=2**40,
                           start=4 * found.seq_len)
    assert above.seq_len == found.seq_len


def test_the_host_budget_ends_the_row_where_it_runs_out_first(found, monkeypatch):
    """CPU compiles report no host bytes: the compiled figures are given host bytes growing with the
    row, as a remat "offload" step's layer inputs in host memory do."""
    real, per_token = PL.step_memory, 1000

    def with_host(factory, cfg_dict, seq_len, micro_batch, **kw):
        return dataclasses.replace(real(factory, cfg_dict, seq_len, micro_batch, **kw), host_temp=per_token * seq_len)

    monkeypatch.setattr(PL, "step_memory", with_host)
    short = found.seq_len - 2 * GRANULE
    by_host = PL.longest_row(tiny_llama, CFG, BUDGET, granule=GRANULE, loss_fn=llama_loss,
                             host_budget=per_token * short)
    assert by_host.seq_len == short and by_host.host_peak == per_token * short
    assert f"host {M.fmt_bytes(per_token * short)} of" in by_host.describe()
    with pytest.raises(PL.NoRowFits, match=r"row of 32 tokens \(micro-batch 1\) fits: .* host budget"):
        PL.longest_row(tiny_llama, CFG, BUDGET, granule=GRANULE, loss_fn=llama_loss, host_budget=per_token)


def test_a_budget_no_row_fits_is_one_line_naming_it():
    with pytest.raises(PL.NoRowFits) as e:
        PL.longest_row(tiny_llama, CFG, 1000, granule=GRANULE, loss_fn=llama_loss, host_budget=2**40)
    assert "\n" not in str(e.value) and f"of the {M.fmt_bytes(1000)} device budget" in str(e.value)
    assert isinstance(e.value, M.WillNotFitError)  # what `zerojax` commands print as one error line


def test_the_granule_is_a_multiple_of_the_sequence_split():
    assert PL.seq_granule({}) == PL.SEQ_GRANULE == 128
    assert PL.seq_granule({"sequence_parallel_size": 3}) == 384
    assert PL.seq_granule({"sequence_parallel_size": 4}, granule=32) == 32


@pytest.mark.parametrize("answer", [0, 1, 2, 5, 8, 13, 100])
@pytest.mark.parametrize("start", [1, 4, 64])
def test_longest_fitting_finds_the_threshold_with_few_probes(answer, start):
    probed = []

    def fits(n):
        probed.append(n)
        return n <= answer

    n, over = M.longest_fitting(fits, start)
    assert n == answer and over == answer + 1
    assert len(probed) == len(set(probed)) <= 2 * max(answer, start).bit_length() + 2
    # a limit ends the doubling: the limit itself where everything fits
    assert M.longest_fitting(lambda n: True, start, limit=37) == (37, None)
