"""Mesh, the ZeRO leaf rule, stage sharding trees, optimizer-state shardings, micro-batching."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from zerojax.accumulate import accumulate_gradients, split_microbatches
from zerojax.sharding import partition


def test_make_mesh_axes_and_auto_types():
    mesh = partition.make_mesh()
    assert mesh.axis_names == ("data", "tensor")
    assert dict(mesh.shape) == {"data": 8, "tensor": 1}
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    mesh = partition.make_mesh(tensor=2)
    assert dict(mesh.shape) == {"data": 4, "tensor": 2}
    mesh = partition.make_mesh(data=2, devices=jax.devices()[:2])
    assert dict(mesh.shape) == {"data": 2, "tensor": 1}
    with pytest.raises(ValueError, match="autotp_size"):
        partition.make_mesh(tensor=3)


@pytest.mark.parametrize(
    "shape, base, n, threshold, expected",
    [
        ((16, 64), P(), 8, 0, P(None, "data")),          # largest divisible dim
        ((64, 16), P(), 8, 0, P("data", None)),
        ((12, 16), P(), 8, 0, P(None, "data")),          # 12 does not divide by 8
        ((16, 16), P(), 8, 0, P("data", None)),          # ties: the first
        ((16, 64), P(None, "tensor"), 8, 0, P("data", "tensor")),  # dim used by tensor is skipped
        ((6, 10), P(), 8, 0, P(None, None)),             # nothing divides: replicated
        ((16, 64), P(), 8, 2000, P(None, None)),         # below the persistence threshold
        ((16, 64), P(), 1, 0, P(None, None)),            # one data device: nothing to split
        ((), P(), 8, 0, P()),                            # scalar
    ],
)
def test_zero_spec_leaf_rule(shape, base, n, threshold, expected):
    assert partition.zero_spec(shape, base, n, min_elements=threshold) == expected


def test_stage_table():
    shapes = {"w": (32, 64), "b": (64,), "odd": (3, 5)}
    base = {k: P() for k in shapes}
    rows = {s: partition.stage_specs(shapes, base, s, 8, persistence_threshold=100) for s in range(4)}
    sharded, repl = P(None, "data"), P(None, None)
    # stage: (params, grads, master) of "w" (2048 elements, above the threshold)
    assert [(r.params["w"], r.grads["w"], r.master["w"]) for r in rows.values()] == [
        (repl, repl, repl), (repl, repl, sharded), (repl, sharded, sharded), (sharded, sharded, sharded)
    ]
    # "b" (64 elements) stays replicated as a stage-3 param (persistence threshold) but its
    # gradient and optimizer state are partitioned, as DeepSpeed partitions all of them.
    assert rows[3].params["b"] == P(None) and rows[3].grads["b"] == P("data") == rows[3].master["b"]
    assert rows[3].master["odd"] == P(None, None)
    with pytest.raises(ValueError, match="stage"):
        partition.stage_specs(shapes, base, 4, 8)


class Tiny(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(16, 64, rngs=rngs, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")))
        self.down = nnx.Linear(64, 16, rngs=rngs, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")))


def test_logical_axes_map_to_tensor_and_zero_adds_data():
    with nnx.use_eager_sharding(False):
        state = nnx.state(nnx.eval_shape(lambda: Tiny(nnx.Rngs(0))), nnx.Param)
    mesh = partition.make_mesh(tensor=2)  # data 4, tensor 2
    base = partition.tensor_specs(state, mesh)
    assert base["up"]["kernel"] == P(None, "tensor") and base["down"]["kernel"] == P("tensor", None)
    assert base["up"]["bias"] == P()
    abstract = nnx.to_pure_dict(state) if hasattr(nnx, "to_pure_dict") else state.to_pure_dict()
    sh = partition.stage_shardings(abstract, mesh, 3, base_specs=base)
    assert sh.params["up"]["kernel"].spec == P("data", "tensor")
    assert sh.params["down"]["kernel"].spec == P("tensor", "data")
    assert sh.params["up"]["bias"].spec == P("data")
    # without a tensor axis, logical names map to nothing
    mesh1 = partition.make_mesh()
    assert partition.tensor_specs(state, mesh1)["up"]["kernel"] == P(None, None)
    # custom ordered rules: first match wins
    rules = [("embed", "tensor"), ("mlp", "tensor")]
    assert partition.logical_to_mesh(("embed", "mlp"), mesh, rules) == P("tensor", None)


def test_opt_state_follows_params_and_memory_kind():
    mesh = partition.make_mesh()
    master = {"w": jax.ShapeDtypeStruct((32, 64), jnp.float32), "b": jax.ShapeDtypeStruct((64,), jnp.float32)}
    sh = partition.stage_shardings(master, mesh, 1, memory_kind="pinned_host")
    assert sh.master["w"].memory_kind == "pinned_host" and sh.params["w"].memory_kind != "pinned_host"
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    opt = partition.opt_state_shardings(tx, master, sh.master, mesh, memory_kind="pinned_host")
    state = jax.eval_shape(tx.init, master)
    assert jax.tree.structure(opt) == jax.tree.structure(state)
    adam = opt[1][0]
    assert adam.mu["w"].spec == P(None, "data") and adam.nu["b"].spec == P("data")
    assert adam.mu["w"].memory_kind == "pinned_host"
    assert adam.count.spec == P() and adam.count.memory_kind != "pinned_host"
    # the result is usable as out_shardings (structure and divisibility hold)
    jax.jit(tx.init, out_shardings=jax.tree.map(lambda s: s.with_memory_kind("device"), opt)).lower(master)


def test_split_microbatches_is_device_local():
    mesh = partition.make_mesh()
    steps, micro = 2, 3
    x = np.arange(8 * steps * micro)
    out = np.asarray(split_microbatches(jnp.asarray(x), steps, mesh))
    assert out.shape == (steps, 8 * micro)
    # micro-batch k = the k-th `micro` rows of every device's contiguous block
    per_device = x.reshape(8, steps, micro)
    for k in range(steps):
        np.testing.assert_array_equal(out[k], per_device[:, k].reshape(-1))


@pytest.mark.parametrize("steps", [1, 4])
def test_accumulate_matches_full_batch_gradient(steps):
    mesh = partition.make_mesh()
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"w": jax.random.normal(k1, (8, 16))}
    batch = jax.random.normal(k2, (8 * steps * 2, 8))
    shard = jax.tree.map(lambda s: s, partition.stage_shardings(params, mesh, 2).grads)

    def loss_fn(p, x, carry):
        loss = jnp.mean(jnp.tanh(x @ p["w"]) ** 2)
        return loss, {"n": jnp.int32(x.shape[0]), "m": loss}, carry + 1

    batch_s = jax.device_put(batch, NamedSharding(mesh, P("data")))
    run = jax.jit(lambda p, b: accumulate_gradients(
        loss_fn, p, b, steps=steps, mesh=mesh, grad_shardings=shard, loss_scale=8.0, carry=jnp.int32(0)))
    grads, loss, aux, carry = run(params, batch_s)
    ref_loss, ref_grads = jax.value_and_grad(lambda p: loss_fn(p, batch, 0)[0])(params)
    np.testing.assert_allclose(grads["w"] / 8.0, ref_grads["w"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert int(aux["n"]) == batch.shape[0] and int(carry) == steps
    assert grads["w"].sharding.spec == P(None, "data") and grads["w"].dtype == jnp.float32
