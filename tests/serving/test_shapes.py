"""zerojax.serving.shapes: every step shape the engine can pick is one the warm-up compiles, and a
prompt-chunk step's program rows stay within 4x the chunks it has (a lone prompt is not padded to
the whole token budget), checked by enumerating every case of a small configuration."""
from zerojax.serving.shapes import Buckets


def test_chunk_programs_cover_every_step_and_pad_at_most_4x():
    for buckets, budget in ((Buckets(), 2048), (Buckets(min_chunk=512), 2048), (Buckets(min_chunk=8), 48)):
        programs = {(r, c) for r, c, _ in buckets.programs(64, budget, 16, 64, budget)}
        for longest in range(2, budget + 1):
            C = buckets.chunk_length(longest, budget)
            most = buckets.chunk_rows(C, budget)
            assert most * C <= budget or most == 1
            for rows in range(1, most + 1):
                R = buckets.chunk_rows_for(rows, C, budget)
                assert rows <= R < 4 * rows, (budget, C, rows, R)
                assert R <= most and (R, C) in programs, (budget, C, rows, R)
