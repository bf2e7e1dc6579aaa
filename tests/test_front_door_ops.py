"""Every front door runs the same FP8 path (issue 47): one layer's, and `benchmarks.mlp`'s MLP
block's, lowered train step through equinox, flax linen (``dot_general_cls``) and flax nnx
(`fp8jax.nnx.fp8_linear_layers`) holds the same FP8 GEMMs (operand and result types of
forward, dgrad and wgrad) and the same FP8 casts, as many of each, with bf16 and with f32
parameters (bf16 compute). With f32 parameters each door casts the weight to FP8 from f32,
once: no bf16 copy of the weight exists (one rounding, no extra pass)."""

import collections
import re
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU, sqnr_db

import fp8jax
from fp8jax.train._census import lowered_gemm_calls

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` lives at the repository root, not in src/
    sys.path.insert(0, str(ROOT))

pytest.importorskip("flax")
from benchmarks import mlp_flax  # noqa: E402

CFG = fp8jax.Fp8Config(selective=False)
K, N, M = 64, 128, 32
HIDDEN, FFN = 64, 80  # fc1 [64 -> 160] (swiglu), fc2 [80 -> 64]: no two GEMM operands alike
DTYPES = pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])


def _loss(y, g):
    return jnp.sum(y.astype(jnp.float32) * g)


def _lower_eqx(model, x, g):
    """The equinox door: the model (f32 weights too) called on the bf16 input as it is."""
    params, static = eqx.partition(model, eqx.is_array)
    fn = jax.grad(lambda p, x: _loss(eqx.combine(p, static)(x), g), argnums=(0, 1))
    return jax.jit(fn).lower(params, x)


def _lower_linen(module, variables, x, g):
    fn = jax.grad(lambda v, x: _loss(module.apply(v, x), g), argnums=(0, 1))
    return jax.jit(fn).lower(variables, x)


def _lower_nnx(model, x, g):
    from flax import nnx

    graphdef, state = nnx.split(model)
    fn = jax.grad(lambda s, x: _loss(nnx.merge(graphdef, s)(x), g), argnums=(0, 1))
    return jax.jit(fn).lower(state, x)


# ----------------------------------------------------------------------------- one layer
def _layer_doors(dtype, x, g):
    import flax.linen as nn
    from flax import nnx

    layer = eqx.nn.Linear(K, N, use_bias=False, dtype=dtype, key=jax.random.PRNGKey(0))
    dense = nn.Dense(N, use_bias=False, dtype=jnp.bfloat16, param_dtype=dtype,
                     dot_general_cls=fp8jax.flax.fp8_dot_general_cls(CFG))
    linear = nnx.Linear(K, N, use_bias=False, dtype=jnp.bfloat16, param_dtype=dtype,
                        rngs=nnx.Rngs(0))
    return dict(
        equinox=_lower_eqx(fp8jax.fp8_linear_layers(layer, CFG), x, g),
        linen=_lower_linen(dense, dense.init(jax.random.PRNGKey(0), x), x, g),
        nnx=_lower_nnx(fp8jax.nnx.fp8_linear_layers(linear, CFG), x, g),
    )


# ----------------------------------------------------------------------------- the MLP block
def _mlp_doors(dtype, x, g):
    """`benchmarks.mlp`'s block (rmsnorm, swiglu, no biases) as its fp8jax-unfused,
    fp8jax-linen and fp8jax-nnx variants build it, its parameters in ``dtype``."""
    base = fp8jax.nn.FusedMLP(HIDDEN, FFN, activation="swiglu", fp8=False, fused=False,
                              dtype=dtype, key=jax.random.PRNGKey(0))
    return dict(
        equinox=_lower_eqx(fp8jax.fp8_linear_layers(base, CFG), x, g),
        linen=_lower_linen(*mlp_flax.linen_mlp(base, CFG), x, g),
        nnx=_lower_nnx(mlp_flax.nnx_mlp(base, CFG), x, g),
    )


# ----------------------------------------------------------------------------- reading
_FUNC = re.compile(r"^\s*func\.func\s+(?:public\s+|private\s+)?@([\w.$\-]+)", re.M)
_CALL = re.compile(r"\bcall @([\w.$\-]+)")
_CONVERT = re.compile(r"stablehlo\.convert\s+%[^:]*:\s*\(tensor<([^>]*)>\)\s*->\s*tensor<([^>]*)>")


def _type(t: str) -> tuple[tuple[int, ...], str]:
    """``"1x64x128xf32"`` -> ``((64, 128), "f32")`` (a leading 1, the op's batch dim, dropped)."""
    *dims, dtype = t.split("x")
    dims = tuple(int(d) for d in dims)
    return (dims[1:] if dims[:1] == (1,) and len(dims) == 3 else dims), dtype


def _converts(text: str) -> collections.Counter:
    """``(shape, from dtype, to dtype)`` of every convert the program runs from ``main``,
    a function's once per call of it."""
    starts = list(_FUNC.finditer(text))
    bodies = {
        m.group(1): text[m.start() : starts[i + 1].start() if i + 1 < len(starts) else len(text)]
        for i, m in enumerate(starts)
    }

    def walk(name: str, depth: int = 0) -> collections.Counter:
        body = bodies.get(name, "")
        found = collections.Counter()
        for src, dst in _CONVERT.findall(body):
            (shape, a), (_, b) = _type(src), _type(dst)
            found[(shape, a, b)] += 1
        for callee in _CALL.findall(body):
            if callee in bodies and callee != name and depth < 64:
                found += walk(callee, depth + 1)
        return found

    return walk("main")


def _fp8_ops(lowered):
    """(the GEMM calls' types, the count of each FP8 cast's target type). On a GPU the
    GEMMs are the compiled program's (its lowering writes a scaled GEMM as a dot of
    dequantized operands, which XLA rewrites into cuBLASLt's FP8 GEMM) and the casts are
    not counted (Pallas kernels there: custom calls, not converts)."""
    # Operands sorted: a kernel stored [K, N] (flax) makes wgrad x^T.g where [N, K] makes
    # g^T.x, the same FP8 GEMM with its operands swapped.
    if ON_GPU:
        found = fp8jax.inspect.parse_gemms(lowered.compile().as_text())
        gemms = sorted((tuple(sorted(g.operand_types)), g.result_type, g.is_fp8) for g in found)
        return gemms, None
    gemms = sorted(
        (tuple(sorted(g.operand_types)), g.result_type, g.is_fp8)
        for g in lowered_gemm_calls(lowered.as_text())
    )
    casts = collections.Counter()
    for (_, _, dst), n in _converts(lowered.as_text()).items():
        if dst.startswith("f8"):
            casts[dst] += n
    return gemms, casts


def _check_same_fp8_ops(doors, n_gemms):
    want_gemms, want_casts = _fp8_ops(doors["equinox"])
    # A GPU's compiled step drops a forward GEMM whose output the gradient does not read
    # (the loss is linear in it): there, every GEMM left is FP8 and the doors agree.
    count_ok = len(want_gemms) <= n_gemms if ON_GPU else len(want_gemms) == n_gemms
    assert count_ok and want_gemms and all(fp8 for *_, fp8 in want_gemms), want_gemms
    assert want_casts is None or set(want_casts) == {"f8E4M3FN", "f8E5M2"}, want_casts
    for door in ("linen", "nnx"):
        gemms, casts = _fp8_ops(doors[door])
        assert gemms == want_gemms, (door, gemms, want_gemms)
        assert casts == want_casts, (door, casts, want_casts)


def _inputs(rows, cols_in, cols_out):
    kx, kg = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(kx, (rows, cols_in), jnp.bfloat16)
    return x, jax.random.normal(kg, (rows, cols_out), jnp.float32)


@DTYPES
def test_adapters_lower_the_equinox_paths_fp8_ops(dtype):
    _check_same_fp8_ops(_layer_doors(dtype, *_inputs(M, K, N)), 3)


@DTYPES
def test_mlp_block_lowers_to_the_same_fp8_ops_through_every_door(dtype):
    """fc1 and fc2: six FP8 GEMMs, and the same FP8 casts as often, in each door."""
    _check_same_fp8_ops(_mlp_doors(dtype, *_inputs(M, HIDDEN, HIDDEN)), 6)


def _check_f32_weights_cast_once(doors, weights):
    """Each GEMM weight (``(in, out)``: flax stores it so, equinox as ``(out, in)``) is cast to
    e4m3 from f32 exactly once and never converted between f32 and bf16 (no bf16 copy feeds
    its cast); its gradient comes out of the wgrad GEMM in f32."""
    for door, lowered in doors.items():
        converts = _converts(lowered.as_text())
        for k, n in weights:
            stored = (n, k) if door == "equinox" else (k, n)
            mine = {c: count for c, count in converts.items() if c[0] in ((k, n), (n, k))}
            to_fp8 = {c: count for c, count in mine.items() if c[2].startswith("f8")}
            assert to_fp8 == {(stored, "f32", "f8E4M3FN"): 1}, (door, stored, mine)
            assert not [c for c in mine if "bf16" in c[1:]], (door, stored, mine)
        wgrads = [g for g in lowered_gemm_calls(lowered.as_text()) if g.result_type == "f32"]
        assert len(wgrads) == len(weights) and all(g.is_fp8 for g in wgrads), (door, wgrads)


@pytest.mark.skipif(ON_GPU, reason="on a GPU the casts are Pallas kernels (custom calls); the "
                    "CPU lowering shows each cast as a convert")
def test_f32_weight_is_cast_to_fp8_from_f32_once_in_every_door():
    """f32 parameters, bf16 compute (flax's ``param_dtype=f32, dtype=bf16``; in equinox the
    f32 model called on bf16 activations): the FP8 cast reads the f32 weight itself."""
    layer = _layer_doors(jnp.float32, *_inputs(M, K, N))
    _check_f32_weights_cast_once(layer, [(K, N)])
    mlp = _mlp_doors(jnp.float32, *_inputs(M, HIDDEN, HIDDEN))
    _check_f32_weights_cast_once(mlp, [(HIDDEN, 2 * FFN), (FFN, HIDDEN)])


def test_f32_weights_keep_bf16_compute_flax_state_and_numerics(key):
    """With f32 weights (the same in each door) on bf16 input: the output is bf16 (the
    compute dtype), the three doors agree, output and weight gradient match the f32
    reference, and linen's variables are flax's own (f32 ``params``, the six
    ``_overwrite_with_gradient`` variables)."""
    import flax.linen as nn
    from flax import nnx

    kw, kx, kg = jax.random.split(key, 3)
    w = jax.random.normal(kw, (K, N), jnp.float32) / K**0.5  # [in, out]
    x = jax.random.normal(kx, (M, K), jnp.bfloat16)
    g = jax.random.normal(kg, (M, N), jnp.float32)
    layer = fp8jax.fp8_linear_layers(eqx.nn.Linear(K, N, use_bias=False, key=kw), CFG)
    layer = eqx.tree_at(lambda lin: lin.weight, layer, w.T)
    dense = nn.Dense(N, use_bias=False, dtype=jnp.bfloat16,
                     dot_general_cls=fp8jax.flax.fp8_dot_general_cls(CFG))
    variables = dense.init(jax.random.PRNGKey(0), x)
    assert variables["params"]["kernel"].dtype == jnp.float32
    assert set(variables["_overwrite_with_gradient"]["Fp8DotGeneralOp_0"]) == {
        "input_amax_history", "kernel_amax_history", "output_grad_amax_history",
        "input_scale", "kernel_scale", "output_grad_scale"}
    variables = {**variables, "params": {"kernel": w}}
    linear = nnx.Linear(K, N, use_bias=False, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    linear.kernel[...] = w
    fp8jax.nnx.fp8_linear_layers(linear, CFG)
    graphdef, state = nnx.split(linear)

    def run(f, params):  # (d loss / d params, y)
        return jax.grad(lambda p: _loss(f(p, x), g))(params), f(params, x)

    doors = dict(
        equinox=run(lambda p, x: p(x), layer),
        linen=run(dense.apply, variables),
        nnx=run(lambda s, x: nnx.merge(graphdef, s)(x), state),
    )
    dws = dict(equinox=doors["equinox"][0].weight.T, linen=doors["linen"][0]["params"]["kernel"],
               nnx=doors["nnx"][0]["kernel"][...])
    y_ref = x.astype(jnp.float32) @ w
    dw_ref = x.astype(jnp.float32).T @ g
    for name, (_, y) in doors.items():
        assert y.dtype == jnp.bfloat16, name
        assert dws[name].dtype == jnp.float32, name
        assert sqnr_db(y, y_ref) > 25, (name, sqnr_db(y, y_ref))
        assert sqnr_db(dws[name], dw_ref) > 20, (name, sqnr_db(dws[name], dw_ref))
        np.testing.assert_allclose(np.asarray(y, np.float32),
                                   np.asarray(doors["equinox"][1], np.float32), rtol=1e-2,
                                   atol=1e-2)
        np.testing.assert_allclose(dws[name], dws["equinox"], rtol=1e-4, atol=1e-4)
