"""fp8_linear_layers: what it converts, what it skips and why, and its errors."""

import equinox as eqx
import jax
import pytest

import fp8jax
from helpers import normal, sqnr_db

ALL = fp8jax.Fp8Config(selective=False)


class Block(eqx.Module):
    attn: eqx.nn.MultiheadAttention
    mlp: eqx.nn.MLP
    head: eqx.nn.Linear

    def __init__(self, key, width=64):
        k1, k2, k3 = jax.random.split(key, 3)
        self.attn = eqx.nn.MultiheadAttention(4, width, key=k1)
        self.mlp = eqx.nn.MLP(width, width, 4 * width, depth=2, key=k2)
        self.head = eqx.nn.Linear(width, 10, key=k3)  # 10 is not a multiple of 16

    def __call__(self, x):
        x = x + self.attn(x, x, x)
        x = x + jax.vmap(self.mlp)(x)
        return jax.vmap(self.head)(x)


def test_converts_mlp_attention_and_reports_skips(key):
    model = Block(key)
    fp8_model, report = fp8jax.fp8_linear_layers(model, ALL, return_report=True)
    assert set(report.converted) == {
        "attn.query_proj", "attn.key_proj", "attn.value_proj", "attn.output_proj",
        "mlp.layers.0", "mlp.layers.1", "mlp.layers.2",
    }
    assert "not multiples of 16" in report.skipped["head"]
    assert isinstance(fp8_model.attn.query_proj, fp8jax.nn.Linear)
    assert isinstance(fp8_model.head, eqx.nn.Linear)
    assert "7 of 8 linear layers in FP8" in str(report)
    x = normal(key, (32, 64))
    assert sqnr_db(fp8_model(x), model(x)) >= 20.0


def test_selection_policy_skips_small_layers(key):
    cfg = fp8jax.Fp8Config(min_features=64, min_weight_elements=64 * 128 + 1)
    model = eqx.nn.MLP(64, 64, 128, depth=2, key=key)  # 64x128, 128x128, 128x64
    _, report = fp8jax.fp8_linear_layers(model, cfg, return_report=True)
    assert report.converted == ["layers.1"]  # converted something: no warning
    assert "min_weight_elements" in report.skipped["layers.0"]
    _, report = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(selective=False), return_report=True)
    assert len(report.converted) == 3


def test_default_policy_keeps_toy_layers_in_bf16(key):
    with pytest.warns(UserWarning, match="converted no layer"):
        _, report = fp8jax.fp8_linear_layers(eqx.nn.Linear(64, 64, key=key), return_report=True)
    assert report.converted == [] and "too small" in report.skipped[""]


def test_min_tokens_runs_small_batches_in_high_precision(key):
    cfg = fp8jax.Fp8Config(min_features=0, min_weight_elements=0, min_tokens=64)
    model = fp8jax.fp8_linear_layers(eqx.nn.Linear(32, 32, key=key), cfg)
    small = fp8jax.fp8_gemm_report(lambda m, x: m(x), model, normal(key, (16, 32)), stage="lowered")
    large = fp8jax.fp8_gemm_report(lambda m, x: m(x), model, normal(key, (64, 32)), stage="lowered")
    assert small.num_fp8 == 0 and large.num_fp8 == 1


@pytest.mark.parametrize("targets, expected", [
    ("mlp.*", {"mlp.layers.0", "mlp.layers.1", "mlp.layers.2"}),
    (["attn.query_proj", "attn.key_proj"], {"attn.query_proj", "attn.key_proj"}),
    (lambda path, module: path.endswith("output_proj"), {"attn.output_proj"}),
])
def test_targets(key, targets, expected):
    cfg = fp8jax.Fp8Config(selective=False, targets=targets)
    _, report = fp8jax.fp8_linear_layers(Block(key), cfg, return_report=True)
    assert set(report.converted) == expected
    assert report.skipped.get("attn.value_proj", "not in targets") == "not in targets" or "attn.value_proj" in expected


def test_targets_matching_nothing_raise(key):
    with pytest.raises(ValueError, match="match no linear layer"):
        fp8jax.fp8_linear_layers(Block(key), fp8jax.Fp8Config(targets="decoder.*"))


def test_targets_entry_matching_nothing_warns(key):
    """A list entry that selects no layer (a typo) is named, the other entries still apply."""
    cfg = fp8jax.Fp8Config(selective=False, targets=["attn.query_proj", "attn.qeury_proj"])
    with pytest.warns(UserWarning, match=r"targets entries \['attn.qeury_proj'\] match no linear layer"):
        _, report = fp8jax.fp8_linear_layers(Block(key), cfg, return_report=True)
    assert set(report.converted) == {"attn.query_proj"}


def test_model_without_linear_raises(key):
    with pytest.raises(ValueError, match="no linear layer"):
        fp8jax.fp8_linear_layers(eqx.nn.Conv2d(3, 8, 3, key=key))


def test_converting_twice_is_a_noop(key):
    once = fp8jax.fp8_linear_layers(Block(key), ALL)
    twice, report = fp8jax.fp8_linear_layers(once, ALL, return_report=True)
    assert all(a is b for a, b in zip(jax.tree_util.tree_leaves(once), jax.tree_util.tree_leaves(twice), strict=True))
    assert "already FP8" in str(report)


def test_shared_layer_converted_once(key):
    shared = eqx.nn.Linear(32, 32, key=key)
    model = fp8jax.fp8_linear_layers([shared, shared], ALL)
    assert model[0] is model[1]


def test_bad_config_type():
    with pytest.raises(TypeError, match="Fp8Config"):
        fp8jax.fp8_linear_layers(eqx.nn.Linear(16, 16, key=jax.random.PRNGKey(0)), {"scaling": "delayed"})


@pytest.mark.parametrize("kwargs, match", [
    (dict(scaling="dynamic"), "scaling"),
    (dict(fp8_format="e5m2"), "fp8_format"),
    (dict(amax_history_length=0), "amax_history_length"),
    (dict(amax_compute_algo="mean"), "amax_compute_algo"),
    (dict(margin=-1), "margin"),
    (dict(alignment=0), "alignment"),
    (dict(min_tokens=-5), "min_tokens"),
    (dict(targets="(unclosed"), "targets"),
    (dict(targets=[1, 2]), "targets"),
    (dict(on_unsupported="ignore"), "on_unsupported"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fp8jax.Fp8Config(**kwargs)


def test_to_linear_roundtrip(key):
    layer = eqx.nn.Linear(32, 16, key=key)
    back = fp8jax.fp8_linear_layers(layer, ALL).to_linear()
    assert back.weight is layer.weight and back.bias is layer.bias


def test_not_a_model_raises_naming_its_kind(key):
    nn = pytest.importorskip("flax.linen")
    with pytest.raises(TypeError, match=r"flax.linen module \(Dense\).*fp8_dot_general_cls"):
        fp8jax.fp8_linear_layers(nn.Dense(16), ALL)
    nnx = pytest.importorskip("flax.nnx")
    with pytest.raises(TypeError, match=r"flax.nnx module \(Linear\); .*fp8jax.nnx.fp8_linear_layers"):
        fp8jax.fp8_linear_layers(nnx.Linear(16, 16, rngs=nnx.Rngs(0)), ALL)
    # A stand-in for torch.nn.Linear (torch is not a test dependency): same class layout.
    torch_module = type("Module", (), {"__module__": "torch.nn.modules.module"})
    torch_linear = type("Linear", (torch_module,), {"__module__": "torch.nn.modules.linear"})
    with pytest.raises(TypeError, match=r"PyTorch module \(Linear\); fp8jax converts JAX"):
        fp8jax.fp8_linear_layers(torch_linear(), ALL)
    with pytest.raises(TypeError, match=r"got the class Linear, not a model"):
        fp8jax.fp8_linear_layers(eqx.nn.Linear, ALL)
    for leaf, kind in [(jax.numpy.ones((16, 16)), "ArrayImpl"), (3, "int"), (None, "NoneType")]:
        with pytest.raises(TypeError, match=rf"model must be an equinox/haliax .*, got {kind}\."):
            fp8jax.fp8_linear_layers(leaf, ALL)
    with pytest.raises(ValueError, match=r"no linear layer .* found in list"):
        fp8jax.fp8_linear_layers([jax.numpy.ones(3)], ALL)
    with pytest.raises(TypeError, match=r"config must be an fp8jax.Fp8Config, got dict"):
        fp8jax.fp8_linear_layers(eqx.nn.Linear(16, 16, key=key), {"selective": False})
