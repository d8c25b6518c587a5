"""The KV page pool: its plan from the device's free memory with the step's transients kept aside
(what the planned pool and the transients hold fits the share of free memory, one page more
would not), refused with the numbers where one request of max_model_len cannot fit; the compiled step
writing it in place; and the command's missing extra reported in one line."""
import subprocess
import sys

import jax.numpy as jnp
import pytest

from zerojax.generation.families import Geometry
from zerojax.serving import planning
from zerojax.serving.step import pool_bytes_per_page

GEOMETRY = Geometry(layers=4, kv_heads=2, head_dim=16, window=None, max_positions=None, heads=4)
LIMITS = dict(page_size=16, kv_cache_tokens=None, max_num_seqs=8, max_batched_tokens=64, max_model_len=512,
              model_len_limit=4096, vocab=1000)


def test_pool_planned_from_free_memory(monkeypatch):
    free = 48 << 20
    monkeypatch.setattr(planning, "device_free_bytes", lambda device=None: free)
    plan = planning.plan_pages(GEOMETRY, jnp.bfloat16, **LIMITS)
    page = pool_bytes_per_page(GEOMETRY, 16, jnp.bfloat16)
    assert page == 2 * 4 * 16 * 2 * 16 * 2  # keys + values, layers, slots, kv heads, head_dim, bf16 bytes
    pool = (plan.num_pages - 1) * page
    assert pool + plan.reserved_bytes <= 0.9 * free < pool + page + plan.reserved_bytes
    assert plan.reserved_bytes > 0 and plan.max_model_len == 512
    assert f"{plan.cache_tokens:,} tokens" in plan.describe()


def test_pool_too_small_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(planning, "device_free_bytes", lambda device=None: 2 << 20)
    with pytest.raises(ValueError, match="less than one request of max_model_len 512: lower max_model_len"):
        planning.plan_pages(GEOMETRY, jnp.bfloat16, **LIMITS)
    monkeypatch.setattr(planning, "device_free_bytes", lambda device=None: None)  # CPU: no statistics
    plan = planning.plan_pages(GEOMETRY, jnp.float32, **LIMITS)
    assert plan.cache_tokens >= 8 * 512 and plan.free_bytes is None
    asked = planning.plan_pages(GEOMETRY, jnp.float32, **{**LIMITS, "kv_cache_tokens": 1000})
    assert asked.cache_tokens == 1008  # 63 pages of 16


def test_serve_without_the_extra_says_how_to_install_it():
    """`import zerojax` and the engine need no serve extra; the command without it: one line."""
    code = ("import sys; sys.modules['fastapi'] = None; import zerojax, zerojax.serving; zerojax.serving.LLM; "
            "from zerojax.cli import main; sys.exit(main(['serve', '--hf-checkpoint', 'x']))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 1
    assert run.stderr == 'error: zerojax serve needs the serve extra: pip install -e ".[serve]" (fastapi, uvicorn, ' \
                         'prometheus-client)\n'


def test_the_step_updates_the_pool_in_place():
    """The compiled decode step writes the donated pool where it lies: keys and values aliased to
    the outputs, no copy of the pool among its temporaries (a copy per step would double the
    cache's memory and move all of it every token)."""
    import numpy as np
    from flax import nnx

    from zerojax.generation.decoder import ModuleSource
    from zerojax.models import Llama, LlamaConfig
    from zerojax.serving import LLMEngine
    from zerojax.serving import step as step_mod

    model = Llama(LlamaConfig.named("tiny"), rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
    engine = LLMEngine(model, None, max_num_seqs=8, kv_cache_tokens=1 << 17, max_model_len=128)
    graphdef, weights = nnx.split(model)
    R = 8
    rows = step_mod.Rows(np.zeros((R, 1), np.int32), np.zeros(R, np.int32), np.ones(R, np.int32),
                         np.zeros((R, 16), np.int32))
    sampling = step_mod.RowSampling(np.zeros(R, np.float32), np.ones(R, np.float32), np.zeros(R, np.int32),
                                    np.zeros(R, np.uint32), np.zeros(R, np.int32))
    compiled = step_mod.step.lower(weights, engine.keys, engine.values, rows, sampling, None,
                                   source=ModuleSource(graphdef), page_size=16).compile()
    memory = compiled.memory_analysis()
    pool = engine.keys.nbytes + engine.values.nbytes
    assert memory.alias_size_in_bytes >= pool
    assert memory.temp_size_in_bytes < engine.keys.nbytes / 8


@pytest.mark.parametrize("flag", ["--min-rows", "--min-span", "--min-chunk"])
def test_shape_floor_flags_are_checked_when_parsed(flag, capsys):
    from zerojax.cli import build_parser

    args = build_parser().parse_args(["serve", "--hf-checkpoint", "x", flag, "64", "--no-warmup"])
    assert getattr(args, flag[2:].replace("-", "_")) == 64 and args.no_warmup
    for bad in ("3", "0", "many"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--hf-checkpoint", "x", flag, bad])
        assert capsys.readouterr().err.splitlines()[-1] == \
            f"zerojax serve: error: argument {flag}: {bad!r} is not a power of two >= 1 (1, 2, 4, ..., 256, ...)"
