"""`fp8jax.inspect.residuals_report` (issue 49): what a function's backward keeps, counted by
hand on small FP8 and bf16 models, and the FP8 copies whose tensor is also kept in bf16."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import fp8jax
from fp8jax import _jax_compat, _residuals as residuals
from fp8jax.inspect import Residual, ResidualsReport, residuals_report

M, D, F = 16, 32, 64  # tokens, model width, hidden width
CONFIG = fp8jax.Fp8Config(min_tokens=0)  # FP8 at these small sizes


class Dense(eqx.Module):
    """A plain bf16 linear, ``x @ weight.T`` (the bf16 model's layer)."""

    weight: jax.Array

    def __call__(self, x):
        return x @ self.weight.T


class Block(eqx.Module):
    up: eqx.Module
    down: eqx.Module

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x)))


class TwoBlocks(eqx.Module):
    blocks: tuple

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _model(fp8: bool, config=CONFIG) -> TwoBlocks:
    keys = iter(jax.random.split(jax.random.key(0), 4))

    def linear(n_in, n_out):
        if fp8:
            return fp8jax.nn.Linear(n_in, n_out, False, jnp.bfloat16, config, key=next(keys))
        return Dense(jax.random.normal(next(keys), (n_out, n_in), jnp.bfloat16) * 0.1)

    return TwoBlocks(tuple(Block(linear(D, F), linear(F, D)) for _ in range(2)))


X = jnp.ones((M, D), jnp.bfloat16)
# (tokens M, in K, out N) of each linear, in call order
LINEARS = [(M, D, F), (M, F, D)] * 2


def test_every_fp8_linear_keeps_its_input_and_weight_in_fp8_only():
    """Each FP8 linear ``[M, K] x [N, K]`` keeps its input as ``M * K`` bytes of e4m3 (the
    transposed ``[1, K, M]`` copy the weight gradient reads) and its weight as ``N * K``
    bytes (``[1, K, N]``, named ``fp8jax_kernel_fp8``), and five float32 scalars (scales
    and amaxes, named ``fp8jax_gemm_scalars``); neither is kept in bf16 too."""
    report = residuals_report(_model(fp8=True), X)
    assert report.exact
    fp8 = [r for r in report.residuals if r.is_fp8]
    expected = sorted(
        shape for m, k, n in LINEARS for shape in ((1, k, m), (1, k, n))
    )
    assert sorted(r.shape for r in fp8) == expected
    assert {str(r.dtype) for r in fp8} == {"float8_e4m3fn"}
    assert report.by_dtype["float8_e4m3fn"] == sum(m * k + n * k for m, k, n in LINEARS)
    weights = [r for r in fp8 if r.name == "fp8jax_kernel_fp8"]
    assert sorted(r.shape for r in weights) == sorted((1, k, n) for m, k, n in LINEARS)
    scalars = [r for r in report.residuals if r.name == "fp8jax_gemm_scalars"]
    assert len(scalars) == 5 * len(LINEARS) and all(r.size == 1 for r in scalars)
    assert sum(r.nbytes for r in scalars) == 4 * 5 * len(LINEARS)
    # no bf16 copy of an input or a weight: the bf16 activations are the gelus' own
    bf16 = [r for r in report.residuals if str(r.dtype) == "bfloat16" and r.size > 1]
    assert not [r for r in bf16 if r.shape in ((M, D), (D, F), (F, D))]
    assert all(r.shape == (M, F) for r in bf16)
    assert report.bf16_copies_of_fp8_inputs() == []
    # the layers' FP8 state is differentiated, so it is kept as an argument by its path
    arguments = {r.source for r in report.residuals if r.kind == "argument"}
    assert "argument fn.blocks[0].up.dot_general.input_amax_history" in arguments
    fp8_sources = {r.source for r in fp8}
    assert all("jit fp8_gemm_forward" in s for s in fp8_sources), fp8_sources


def test_the_bf16_model_keeps_bf16_inputs_and_weights_instead():
    report = residuals_report(_model(fp8=False), X)
    assert "float8_e4m3fn" not in report.by_dtype
    bf16 = [r for r in report.residuals if str(r.dtype) == "bfloat16"]
    for m, k, n in LINEARS:  # each matmul's input and weight (transposed: ``weight.T``)
        assert any(r.shape == (m, k) for r in bf16), (m, k)
        assert any(r.shape == (k, n) for r in bf16), (k, n)
    fp8 = residuals_report(_model(fp8=True), X)
    inputs_and_weights = 2 * sum(m * k + n * k for m, k, n in LINEARS)
    assert report.by_dtype["bfloat16"] - fp8.by_dtype["bfloat16"] >= inputs_and_weights


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_totals_equal_saved_activation_bytes(fp8):
    model = _model(fp8)
    report = residuals_report(model, X)
    assert report.total_bytes() == fp8jax.saved_activation_bytes(model, X)
    assert report.total_bytes(dim=M) == fp8jax.saved_activation_bytes(model, X, dim=M)
    assert report.total_bytes() == sum(report.by_dtype.values()) == sum(report.by_kind.values())
    assert report.total_bytes(kind="argument") == report.by_kind.get("argument", 0)


def _reused(model, x):
    """A block whose hidden activation is also squared: ``g * g`` keeps ``g`` in bf16 for
    its backward, next to the FP8 copy ``down`` keeps."""
    block = model.blocks[0]
    g = jax.nn.gelu(block.up(x))
    return block.down(g).sum() + (g * g).sum()


@pytest.mark.parametrize("recipe", ["tensor", "rowwise"])
def test_a_bf16_copy_of_an_fp8_input_is_found(recipe):
    config = fp8jax.Fp8Config(min_tokens=0, recipe=recipe)
    model = _model(fp8=True, config=config)
    report = residuals_report(_reused, model, X)
    pairs = report.bf16_copies_of_fp8_inputs()
    assert len(pairs) == 1, report
    fp8_copy, bf16_copy = pairs[0]
    assert fp8_copy.shape == (1, F, M) and fp8_copy.is_fp8 and fp8_copy.name == "fp8jax_input_fp8"
    assert bf16_copy.shape == (M, F) and str(bf16_copy.dtype) == "bfloat16"
    assert fp8_copy.tensor == bf16_copy.tensor
    assert "FP8 residuals also kept in high precision" in str(report)
    # the candidates: the proven pair, and the other same-size bf16 activations (gelu's)
    candidates = report.bf16_copies_of_fp8_inputs(candidates=True)
    assert pairs[0] in candidates and len(candidates) > 1
    assert all(f.size == h.size for f, h in candidates)
    # the plain model keeps no such copy
    assert residuals_report(_model(fp8=True, config=config), X).bf16_copies_of_fp8_inputs() == []


def test_arguments_read_by_their_parameter_names():
    def loss(model, x, *, scale):
        return (model(x) * scale).sum()

    report = residuals_report(loss, _model(fp8=True), X, scale=jnp.float32(2.0))
    arguments = {r.source for r in report.residuals if r.kind == "argument"}
    assert "argument model.blocks[1].down.dot_general.kernel_amax_history" in arguments
    assert "argument scale" in arguments  # kept for the gradient of the product
    assert all(s.startswith("argument model.") or s == "argument scale" for s in arguments)


def test_str_renders_a_table_with_totals():
    report = residuals_report(_model(fp8=True), X)
    text = str(report)
    assert text.startswith(f"{len(report.residuals)} residuals")
    assert "float8_e4m3fn[1, 32, 16]" in text and "by dtype: float32" in text
    assert "fp8jax_kernel_fp8" in text and "by kind: " in text
    assert repr(report) == text
    assert len(text.splitlines()) < len(report.residuals)  # equal rows merged


def test_without_jax_source_lines_the_lines_read_unknown(monkeypatch):
    """A JAX without the source summary (an optional internal): the same residuals and
    tensors, the lines ``"unknown"``."""
    exact = residuals_report(_model(fp8=True), X)
    summary = ("jax._src.source_info_util", "summarize")
    gone = _jax_compat._BY_NAME[summary]._replace(module="jax._src.no_such_module")
    monkeypatch.setitem(_jax_compat._BY_NAME, summary, gone)
    assert _jax_compat.source_line(object()) == ""
    report = residuals_report(_model(fp8=True), X)
    assert [(r.shape, r.nbytes, r.tensor) for r in report.residuals] == [
        (r.shape, r.nbytes, r.tensor) for r in exact.residuals
    ]
    assert {r.line for r in report.residuals if r.kind == "activation"} == {"unknown"}


def test_the_fallback_lists_the_closure_leaves(monkeypatch):
    """A vjp jaxpr that does not line up (a JAX that changed it): the leaves of the
    backward's closure, sources unknown, the same bytes by dtype."""
    exact = residuals_report(_model(fp8=True), X)
    monkeypatch.setattr(residuals, "_lines_up", lambda *a: False)
    report = residuals_report(_model(fp8=True), X)
    assert not report.exact and report.by_dtype == exact.by_dtype
    assert {(r.kind, r.source, r.tensor) for r in report.residuals} == {
        ("unknown", "unknown", None)
    }
    assert report.bf16_copies_of_fp8_inputs() == []
    assert "sources unknown" in str(report)


def test_residuals_report_rejects_a_non_callable():
    with pytest.raises(TypeError, match="residuals_report: fn must be a callable"):
        residuals_report(X, X)


def test_public_names():
    assert fp8jax.residuals_report is residuals_report
    assert fp8jax.ResidualsReport is ResidualsReport
    assert Residual.__module__ == "fp8jax._residuals"
