"""Every module is built through its ``__init__``: alternate constructors (``from_state``,
``from_linear``, ``from_modules``) and copies (``with_*``) call it, so validation
(``__check_init__``) runs and a new field cannot be missed on a side path; none of
``src/fp8jax`` sets fields behind a constructor's back (``object.__setattr__``)."""

import ast
import dataclasses
import pickle
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import fp8jax
from fp8jax import Fp8Config, Fp8DotGeneral
from fp8jax.nn import FusedMLP, GroupedLinear, Linear
from fp8jax._ops.dot import WeightSharding
from fp8jax._ops.expert_parallel import ExpertSharding
from fp8jax._state import STATE_FIELDS
from fp8jax.train._model import ModelConfig, Transformer

SRC = Path(fp8jax.__file__).resolve().parent
CFG = Fp8Config(selective=False)
BYPASSES = {"__setattr__", "__new__", "__delattr__"}


def _bypasses(source: str) -> list[int]:
    """Lines of ``object.__setattr__`` / ``object.__new__`` / ``object.__delattr__``."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and node.attr in BYPASSES
        and isinstance(node.value, ast.Name)
        and node.value.id == "object"
    ]


def test_the_check_finds_bypasses():
    assert _bypasses("x = object.__new__(C)\nobject.__setattr__(x, 'a', 1)\n") == [1, 2]
    assert _bypasses("setattr(self, 'a', 1)\nnew = C.__new__(C)\n") == []


def test_no_module_is_built_behind_its_constructor():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 50, SRC
    found = {str(f.relative_to(SRC)): _bypasses(f.read_text()) for f in files}
    assert not {f: lines for f, lines in found.items() if lines}


# ----------------------------------------------------------------------------- helpers
def _assert_same(a, b):
    """Same pytree (structure, static fields included) and the same leaf arrays."""
    assert type(a) is type(b)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(x, y)


def _shares_leaves(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(x is y for x, y in zip(la, lb))


def _checked(cls):
    """A subclass of ``cls`` with a defaulted field and a ``__check_init__`` that counts its
    runs: what an object built behind ``__init__`` would miss."""

    class Checked(cls):
        tag: str = eqx.field(static=True, default="default")

        def __check_init__(self):
            Checked.runs += 1

    Checked.runs = 0
    return Checked


def _mesh():
    return Mesh(np.array(jax.devices()[:1]), ("fsdp",))


def _state(op):
    return {name: getattr(op, name) for name in STATE_FIELDS + ("guard",)}


# ----------------------------------------------------------------------------- Fp8DotGeneral
def test_dot_general_from_state_is_the_op_built_normally():
    op = Fp8DotGeneral(CFG, stack_shape=(3,))
    _assert_same(Fp8DotGeneral.from_state(CFG, _state(op)), op)
    _assert_same(Fp8DotGeneral(CFG, state=_state(op)), op)
    assert _shares_leaves(Fp8DotGeneral.from_state(CFG, _state(op)), op)
    no_guard = Fp8DotGeneral.from_state(CFG, {n: getattr(op, n) for n in STATE_FIELDS})
    assert no_guard.guard is None and no_guard.weight_sharding is None
    with pytest.raises(ValueError, match=r"missing state fields \['nonfinite_count'\]"):
        Fp8DotGeneral.from_state(CFG, {n: getattr(op, n) for n in STATE_FIELDS[:-1]})


def test_dot_general_with_weight_sharding_shares_the_state():
    op = Fp8DotGeneral(CFG)
    _assert_same(op.with_weight_sharding(None), op)
    ws = WeightSharding(_mesh(), (None, "fsdp"), ("fsdp",))
    placed = op.with_weight_sharding(ws)
    assert placed.weight_sharding == ws and placed.config is op.config
    assert _shares_leaves(placed, op)
    _assert_same(placed.with_weight_sharding(None), op)
    assert Fp8DotGeneral(CFG, weight_sharding=ws).weight_sharding == ws


def test_dot_general_alternate_constructors_run_init():
    Checked = _checked(Fp8DotGeneral)
    op = Checked(CFG)
    made = [Checked.from_state(CFG, _state(op)), op.with_weight_sharding(None)]
    assert Checked.runs == 3
    for new in made:
        assert type(new) is Checked and new.tag == "default"
        _assert_same(new, op)


# ----------------------------------------------------------------------------- Linear
def test_from_linear_is_the_linear_built_normally(key):
    built = Linear(32, 16, config=CFG, key=key)
    wrapped = Linear.from_linear(eqx.nn.Linear(32, 16, key=key), CFG)
    _assert_same(wrapped, built)
    _assert_same(Linear(32, 16, config=CFG, weight=built.weight, bias=built.bias), built)
    no_bias = Linear.from_linear(eqx.nn.Linear(32, 16, use_bias=False, key=key), CFG)
    _assert_same(no_bias, Linear(32, 16, use_bias=False, config=CFG, key=key))


def test_from_linear_of_a_stacked_linear_gets_stacked_state(key):
    stacked = eqx.filter_vmap(lambda k: eqx.nn.Linear(32, 16, key=k))(jax.random.split(key, 3))
    layer = Linear.from_linear(stacked, CFG)
    assert layer.weight is stacked.weight and layer.bias is stacked.bias
    _assert_same(layer.dot_general, Fp8DotGeneral(CFG, stack_shape=(3,)))
    by_vmap = eqx.filter_vmap(lambda k: Linear(32, 16, config=CFG, key=k))(
        jax.random.split(key, 3)
    )
    _assert_same(layer, by_vmap)


def test_linear_init_checks_given_arrays_and_needs_a_key_otherwise(key):
    w = jnp.ones((32, 16))
    with pytest.raises(ValueError, match=r"fp8jax.nn.Linear: weight has shape \(32, 16\)"):
        Linear(32, 16, weight=w, bias=None)
    with pytest.raises(TypeError, match=r"pass key="):
        Linear(32, 16)


def test_from_linear_runs_init():
    Checked = _checked(Linear)
    new = Checked.from_linear(eqx.nn.Linear(32, 16, key=jax.random.PRNGKey(0)), CFG)
    assert Checked.runs == 1 and type(new) is Checked and new.tag == "default"


# ----------------------------------------------------------------------------- FusedMLP
def _parts(hidden, ffn, key):
    k1, k2 = jax.random.split(key)
    fc1 = eqx.nn.Linear(hidden, 2 * ffn, use_bias=False, key=k1)
    fc2 = eqx.nn.Linear(ffn, hidden, use_bias=False, key=k2)
    return eqx.nn.RMSNorm(hidden, use_bias=False), fc1, fc2


@pytest.mark.parametrize("fp8", [True, False])
def test_from_modules_is_the_block_built_normally(key, fp8):
    built = FusedMLP(64, 128, fp8=fp8, config=CFG, key=key)
    norm, fc1, fc2 = _parts(64, 128, key)
    _assert_same(FusedMLP.from_modules(norm, fc1, fc2, activation="swiglu", fp8=fp8, config=CFG),
                 built)


def test_fused_mlp_copies_keep_every_field(key):
    mlp = FusedMLP(64, 128, config=CFG, residual=True, eps=1e-3, key=key)
    _assert_same(mlp.with_fused(True), mlp)
    assert _shares_leaves(mlp.with_fused(False), mlp)
    _assert_same(mlp.with_fused(False).with_fused(True), mlp)
    _assert_same(mlp.with_gate_block(64).with_gate_block(None), mlp)
    blocked = mlp.with_gate_block(64)
    for f in dataclasses.fields(mlp):
        if f.name not in ("fc1", "gate_block"):
            assert getattr(blocked, f.name) is getattr(mlp, f.name), f.name
    assert _shares_leaves(blocked.fc1.dot_general, mlp.fc1.dot_general)  # the state is kept
    assert blocked.gate_block == 64 and not mlp.with_fused(False).fused


def test_stacked_fused_mlp_copies(key):
    stacked = eqx.filter_vmap(lambda k: FusedMLP(64, 128, config=CFG, key=k))(
        jax.random.split(key, 2)
    )
    unfused = stacked.with_fused(False)
    assert not unfused.fused and _shares_leaves(unfused, stacked)
    _assert_same(stacked.with_gate_block(64).with_gate_block(None), stacked)


def test_fused_mlp_alternate_constructors_run_init(key):
    Checked = _checked(FusedMLP)
    mlp = Checked.from_modules(*_parts(64, 128, key), activation="swiglu", config=CFG)
    made = [mlp.with_fused(False), mlp.with_gate_block(64)]
    assert Checked.runs == 3
    assert all(type(m) is Checked and m.tag == "default" for m in made)
    with pytest.raises(TypeError, match=r"pass key="):
        FusedMLP(64, 128)


# ----------------------------------------------------------------------------- GroupedLinear
@pytest.mark.parametrize("fp8", [True, False])
def test_grouped_linear_copies_keep_every_field(key, fp8):
    layer = GroupedLinear(4, 32, 16, fp8=fp8, config=CFG, key=key)
    _assert_same(layer.with_backend(layer.backend), layer)
    _assert_same(layer.with_expert_sharding(None), layer)
    experts = ExpertSharding(_mesh(), "fsdp")
    placed = layer.with_backend("reference").with_expert_sharding(experts)
    assert placed.backend == "reference" and placed.expert_sharding == experts
    assert _shares_leaves(placed, layer) and (placed.fp8_state is None) == (not fp8)
    given = GroupedLinear(4, 32, 16, fp8=fp8, config=CFG, weight=layer.weight)
    _assert_same(given, layer)


def test_grouped_linear_init_checks_a_given_weight():
    with pytest.raises(ValueError, match=r"GroupedLinear: weight has shape \(4, 16, 32\)"):
        GroupedLinear(4, 32, 16, weight=jnp.ones((4, 16, 32)))
    with pytest.raises(TypeError, match=r"pass key="):
        GroupedLinear(4, 32, 16)


def test_grouped_linear_copies_run_init(key):
    Checked = _checked(GroupedLinear)
    layer = Checked(4, 32, 16, config=CFG, key=key)
    made = [layer.with_backend("reference"), layer.with_expert_sharding(None)]
    assert Checked.runs == 3
    assert all(type(m) is Checked and m.tag == "default" for m in made)


# ----------------------------------------------------------------------------- Transformer
def test_transformer_with_token_split_shares_the_model():
    model = Transformer(ModelConfig(dim=32, layers=1, heads=2, kv_heads=2, ffn=64, seq=16),
                        key=jax.random.PRNGKey(0))
    _assert_same(model.with_token_split(None), model)
    split = model.with_token_split((_mesh(), ("fsdp",), "tensor"))
    assert split.token_split[1:] == (("fsdp",), "tensor") and _shares_leaves(split, model)
    _assert_same(split.with_token_split(None), model)


# ----------------------------------------------------------------------------- Fp8Config
def test_config_is_normalised_before_it_is_stored():
    spelled = Fp8Config("current", None, np.int64(8), margin=np.float32(1.0),
                        selective=np.True_, targets=["a", "b"], recipe="rowwise")
    plain = Fp8Config(scaling="current", amax_history_length=8, margin=1.0, targets=("a", "b"),
                      recipe=fp8jax._recipe.RowWise(margin=1.0))
    assert spelled == plain and hash(spelled) == hash(plain)
    assert type(spelled.amax_history_length) is int and type(spelled.margin) is float
    assert spelled.recipe == fp8jax._recipe.RowWise(margin=1.0)
    assert dataclasses.replace(spelled) == spelled
    assert dataclasses.replace(spelled, margin=2.0).recipe.margin == 2.0
    assert pickle.loads(pickle.dumps(spelled)) == spelled
    assert list(jax.tree_util.tree_leaves(spelled)) == [spelled]  # not a pytree node


def test_config_signature_and_argument_errors_are_the_constructors():
    """``Fp8Config.__init__`` is a plain function: its signature names every keyword (the
    stored fields and the recipe's settings, `fp8jax._config.DEFAULTS`), once, and a wrong
    call gets Python's own TypeError."""
    import inspect

    names = list(inspect.signature(Fp8Config).parameters)
    fields = [f.name for f in dataclasses.fields(Fp8Config)]
    assert sorted(names) == sorted(fields + list(fp8jax._config.DEFAULTS))
    assert [n for n in names if n in fields] == fields
    with pytest.raises(TypeError, match=r"multiple values for argument 'scaling'"):
        Fp8Config("current", scaling="delayed")
    with pytest.raises(TypeError, match=r"positional argument"):
        Fp8Config(*[None] * 30)
