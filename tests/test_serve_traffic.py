"""benchmarks/serve_traffic.py: the steady-state output rate of a closed-loop run counts only the tokens
that arrive while every slot holds a request, checked against a run built by hand where that rate is
known (4 slots, one token a slot every 10 ms once its prompt is in) and against a brute-force count."""
import random

from benchmarks.serve_traffic import figures, steady_rate


def closed_loop(concurrency, outputs, first_token=0.05, gap=0.01):
    """Per request (start, token times) of a closed loop: a slot starts its next request when the
    one before ends; each request's first token `first_token` after its start, then one every `gap`."""
    slots, runs = [0.0] * concurrency, []
    for n in outputs:
        i = min(range(concurrency), key=slots.__getitem__)
        start = slots[i]
        times = [start + first_token + k * gap for k in range(n)]
        runs.append((start, times))
        slots[i] = times[-1]
    return runs


def test_steady_rate_is_the_full_load_rate_not_the_tail():
    # 4 slots, 40 requests of 20 tokens, then one of 400: the whole run's rate is pulled down by
    # the long one running alone; while all 4 slots are busy each gives 20 tokens a request, a
    # request every 50 ms + 19 x 10 ms
    runs = closed_loop(4, [20] * 40 + [1000])
    steady = steady_rate(4, runs)
    whole = figures("x", 4, runs, max(t for _, ts in runs for t in ts))
    expected = 4 * 20 / (0.05 + 19 * 0.01)
    assert abs(steady - expected) / expected < 0.05, (steady, expected)
    assert whole["output_tokens_per_s"] < 0.5 * steady
    assert whole["steady_tokens_per_s"] == steady


def test_steady_rate_counts_the_window_as_a_brute_force_count_does():
    rng = random.Random(0)
    runs = closed_loop(3, [rng.randint(2, 30) for _ in range(30)], gap=0.007)
    starts = sorted(s for s, _ in runs)
    w0 = max(ts[0] for s, ts in sorted(runs)[:3])
    w1 = starts[-1]
    count = sum(1 for _, ts in runs for t in ts if w0 <= t <= w1)
    assert steady_rate(3, runs) == round(count / (w1 - w0), 1)


def test_too_few_requests_for_a_steady_state():
    assert steady_rate(4, closed_loop(4, [5, 5, 5, 5])) is None
