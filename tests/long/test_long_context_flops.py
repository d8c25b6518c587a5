"""benchmarks/long_context_bench.py's FLOPs a token count the query-key pairs the attention mask
keeps (causal within each packed document, none across documents), checked against a brute-force
count of the mask built from the bench's own packed rows; the 32K / 2K comparison reads tokens/s
and the FLOP/s of that count."""
import json

import numpy as np
import pytest

from benchmarks import cases_scale
from benchmarks import long_context_bench as bench
from zerojax.planning import estimate as E


def brute_force_pairs(seq: int, docs: int) -> int:
    """Every (query, key) the mask keeps in the bench's row: key at or before the query, both of
    one document (the row's segment ids; one document: no segment ids, causal over the row)."""
    seg = bench.batch_of(1, seq, 256, docs).get("segment_ids", np.ones((1, seq), np.int32))[0]
    q, k = np.meshgrid(np.arange(seq), np.arange(seq), indexing="ij")
    return int(((k <= q) & (seg[:, None] == seg[None, :])).sum())


@pytest.mark.parametrize("seq,docs", [(16, 1), (16, 4), (17, 4), (50, 3), (5, 8)])
def test_kept_pairs_match_the_mask(seq, docs):
    assert bench.kept_pairs(seq, docs) == brute_force_pairs(seq, docs)


def test_flops_per_token_count_the_kept_pairs_only():
    """12 FLOPs per kept pair, per unit of attention width, per layer (forward 4: q.k and p.v;
    backward twice that), over the row's tokens, on top of 6N; the dense count (`zerojax
    estimate`'s) charges all T^2 pairs. Remat "full" recomputes the attention's forward: 4 more a pair."""
    shape = E.ModelShape(params=1000, layer_params=800, layers=3, d_model=8, seq_len=0, attn_width=8)
    seq, docs = 64, 4
    pairs = brute_force_pairs(seq, docs)
    want = 6 * 1000 + 12 * 3 * 8 * pairs / seq
    assert bench.masked_flops_per_token(shape, seq, docs) == pytest.approx(want)
    dense = E.train_flops_per_token(E.ModelShape(1000, 800, 3, 8, seq, attn_width=8))
    assert dense == pytest.approx(6 * 1000 + 12 * 3 * 8 * seq)  # every token charged all 64 keys
    full = 6 * 1000 + 2 * 800 + 16 * 3 * 8 * pairs / seq
    assert bench.masked_flops_per_token(shape, seq, docs, "full") == pytest.approx(full)


def test_the_long_over_short_comparison_is_in_tokens_and_kept_flops(tmp_path):
    rows = [{"bench": "throughput", "seq": 2048, "tokens_per_s_per_device": 1000.0, "flops_per_token": 2.0},
            {"bench": "throughput", "seq": 32768, "tokens_per_s_per_device": 800.0, "flops_per_token": 2.2}]
    (tmp_path / "long-context-throughput.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = cases_scale.long_context_comparisons(str(tmp_path), "long-context")[0]
    assert record["tokens_per_s_ratio"] == 0.8
    assert record["ratio_long_over_short"] == pytest.approx(0.88) and record["met"] is False
