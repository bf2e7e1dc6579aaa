"""flax's own FP8 tests, run against fp8jax's flax adapter with every GEMM in FP8.

Ported from ``Fp8Test`` in flax's ``tests/linen/linen_test.py``
(https://github.com/google/flax/blob/main/tests/linen/linen_test.py). The assertions and
tolerances are flax's, verbatim. Adapted: the objects under test (fp8jax's `Fp8Einsum`
and `Fp8DotGeneralOp` with ``Fp8Config(selective=False)`` instead of flax's ops, so the
collection entry is named ``Fp8DotGeneralOp_0``); only flax's OCP formats (e4m3/e5m2,
Hopper's; NANOO's fnuz formats are AMD's); in ``test_fp8_meta_dtype`` the reused op is
fp8jax's GEMM (an identity kernel, so the carried value is flax's) and the state is not
converted to flax's ``fp32_max_grad`` by hand: fp8jax's op does that itself.
flax's ``fp8_ops.qdq`` and ``compute_scale`` stay: the test's input cast and reference.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl.testing import parameterized

nn = pytest.importorskip("flax.linen")
from flax.linen import fp8_ops  # noqa: E402
from flax.training import train_state  # noqa: E402

import fp8jax  # noqa: E402
import fp8jax.flax as fp8flax  # noqa: E402

random = jax.random
ALL_FP8 = fp8jax.Fp8Config(selective=False)
QUANT_CLS = functools.partial(fp8flax.Fp8DotGeneralOp, config=ALL_FP8)
QUANT_NAME = "Fp8DotGeneralOp"


class Fp8Test(parameterized.TestCase):
  @parameterized.parameters(
    {'x_shape': (16, 32), 'y_shape': (32, 64), 'g_shape': (16, 64), 'eqn': 'mk,kn->mn'},
    {'x_shape': (2, 3, 32), 'y_shape': (64, 32), 'g_shape': (2, 3, 64), 'eqn': '...k,nk->...n'},
    {'x_shape': (2, 3, 64), 'y_shape': (64, 32), 'g_shape': (2, 3, 32), 'eqn': '...k,kn->...n'},
  )
  def test_fp8_einsum(self, x_shape, y_shape, g_shape, eqn):
    rng, key1, key2, key3 = random.split(random.key(42), 4)
    x = random.normal(key1, x_shape)
    y = random.normal(key2, y_shape)
    g = random.normal(key3, g_shape)
    e4m3_dtype = jnp.float8_e4m3fn
    e5m2_dtype = jnp.float8_e5m2
    cast_to_representable = functools.partial(
        fp8_ops.qdq,
        scale=jnp.ones((1,)),
        compute_dtype=jnp.float32,
    )

    x = cast_to_representable(x, e4m3_dtype)
    y = cast_to_representable(y, e4m3_dtype)
    g = cast_to_representable(g, e5m2_dtype)

    p = fp8flax.Fp8Einsum(config=ALL_FP8)
    vars = p.init(rng, eqn, x, y)
    def loss_fn(vars, x, y):
      out = p.apply(vars, eqn, x, y)
      return jnp.sum(out * g.astype(out.dtype))
    step_fn = jax.value_and_grad(loss_fn, argnums=[1, 2])
    out, grads = jax.jit(step_fn)(vars, x, y)

    def loss_fn_ref(x, y):
      out = jnp.einsum(eqn, x, y)
      return jnp.sum(out * g.astype(out.dtype))
    step_fn_ref = jax.value_and_grad(loss_fn_ref, argnums=[0, 1])
    out_ref, grads_ref = jax.jit(step_fn_ref)(x, y)

    np.testing.assert_allclose(out, out_ref, atol=1e-02, rtol=1e-02)
    np.testing.assert_allclose(grads[0], grads_ref[0], atol=1e-02, rtol=1e-02)
    np.testing.assert_allclose(grads[1], grads_ref[1], atol=1e-02, rtol=1e-02)
    # fp8jax: every GEMM of the step (forward, dgrad, wgrad) is an FP8 GEMM
    report = fp8jax.fp8_gemm_report(step_fn, vars, x, y, stage="lowered")
    assert len(report.gemms) == 3 and report.all_fp8, report

  def test_fp8_dot_general_injection(self):
    # Used to cast the inputs to be representable in FP8, so that the difference
    # of the results from the original gemm and fp8 gemm is small.
    cast_to_representable = functools.partial(
      fp8_ops.qdq,
      scale=jnp.ones((1,)),
      compute_dtype=jnp.float32,
    )

    e4m3_dtype, e5m2_dtype = jnp.float8_e4m3fn, jnp.float8_e5m2

    init_key, random_key = random.split(random.PRNGKey(seed=123), 2)
    x = cast_to_representable(
      random.uniform(random_key, (16, 32)), e4m3_dtype
    )
    dy = cast_to_representable(
      random.uniform(random_key, (16, 64)), e5m2_dtype
    )

    quant_cls = QUANT_CLS

    def run(fp8_injection, expected_shapes):
      p = nn.DenseGeneral(features=64, name='dense')

      if fp8_injection:
        p.dot_general_cls = quant_cls

      init_fn = jax.jit(p.init_with_output)
      y, initial_vars = init_fn(init_key, x)
      var_shapes = jax.tree_util.tree_map(jnp.shape, initial_vars)
      self.assertEqual(var_shapes, expected_shapes)

      def _train(variables, x):
        y = p.apply(variables, x)
        loss = y * dy
        return jnp.mean(loss)

      train_fn = jax.jit(jax.value_and_grad(_train, argnums=[0, 1]))
      outputs, grads = train_fn(initial_vars, x)
      return outputs, grads

    expected_shapes_original = {
      'params': {'kernel': (32, 64), 'bias': (64,)},
    }

    expected_shapes_new = {
      'params': {'kernel': (32, 64), 'bias': (64,)},
      fp8_ops.OVERWRITE_WITH_GRADIENT: {
        f'{QUANT_NAME}_0': {
          'input_amax_history': (1024,),
          'kernel_amax_history': (1024,),
          'output_grad_amax_history': (1024,),
          'input_scale': (1,),
          'kernel_scale': (1,),
          'output_grad_scale': (1,),
        }
      },
    }
    output1a, output1b = run(False, expected_shapes_original)
    output2a, output2b = run(True, expected_shapes_new)
    dw1, dw2 = output1b[0]['params']['kernel'], output2b[0]['params']['kernel']
    dx1, dx2 = output1b[1], output2b[1]

    np.testing.assert_allclose(output1a, output2a, atol=1e-02)
    np.testing.assert_allclose(dw1, dw2, atol=1e-04)
    np.testing.assert_allclose(dx1, dx2, atol=1e-04)

  def test_fp8_train_state(self):
    key, init_key, random_key = random.split(random.PRNGKey(seed=123), 3)
    x = random.uniform(random_key, (16, 16), dtype=jnp.float32)

    quant_cls = QUANT_CLS
    dense = nn.DenseGeneral(
      features=32, use_bias=True, dot_general_cls=quant_cls
    )

    init_fn = jax.jit(dense.init)
    variables = init_fn(init_key, x)
    opt = optax.adam(learning_rate=0.1)
    state = train_state.TrainState.create(
      params=variables, tx=opt, apply_fn=dense.apply
    )

    def _roll_and_update(amax_h, update):
      return jnp.roll(amax_h, shift=-1, axis=0).at[0].set(update)

    def _train_loss(state, x, dy):
      def loss_fn(vars):
        y = state.apply_fn(vars, x)
        loss = y * dy.astype(y.dtype)
        return jnp.sum(loss)

      grad_fn = jax.grad(loss_fn)
      grads = grad_fn(state.params)
      state = state.apply_gradients(grads=grads)
      return state

    train_fn = jax.jit(_train_loss)

    scale_x, amax_history_x = jnp.ones(()), jnp.zeros((1024,))
    scale_k, amax_history_k = jnp.ones(()), jnp.zeros((1024,))
    scale_g, amax_history_g = jnp.ones(()), jnp.zeros((1024,))
    e4m3_dtype, e5m2_dtype = jnp.float8_e4m3fn, jnp.float8_e5m2
    e4m3_max = jnp.finfo(e4m3_dtype).max.astype(jnp.float32)
    e5m2_max = jnp.finfo(e5m2_dtype).max.astype(jnp.float32)

    for _ in range(5):
      key, random_key = random.split(key, 2)
      x = random.normal(random_key, (16, 16), dtype=jnp.float32)
      g = random.normal(random_key, (16, 32), dtype=jnp.float32)
      k = state.params['params']['kernel']

      # Manually compute the expected amax history and scaling factors.
      amax_from_history_x = jnp.max(amax_history_x, axis=0)
      amax_from_history_k = jnp.max(amax_history_k, axis=0)
      amax_from_history_g = jnp.max(amax_history_g, axis=0)
      scale_x = fp8_ops.compute_scale(amax_from_history_x, scale_x, e4m3_max)
      scale_k = fp8_ops.compute_scale(amax_from_history_k, scale_k, e4m3_max)
      scale_g = fp8_ops.compute_scale(amax_from_history_g, scale_g, e5m2_max)
      amax_history_x = _roll_and_update(amax_history_x, jnp.max(jnp.abs(x)))
      amax_history_k = _roll_and_update(amax_history_k, jnp.max(jnp.abs(k)))
      amax_history_g = _roll_and_update(amax_history_g, jnp.max(jnp.abs(g)))

      state = train_fn(state, x, g)

      rtol, atol = 0.001, 0.001
      fp8_vars = state.params[fp8_ops.OVERWRITE_WITH_GRADIENT][
        f'{QUANT_NAME}_0'
      ]
      np.testing.assert_allclose(
        fp8_vars['input_amax_history'],
        amax_history_x,
        rtol=rtol,
        atol=atol,
      )
      np.testing.assert_allclose(
        fp8_vars['kernel_amax_history'],
        amax_history_k,
        rtol=rtol,
        atol=atol,
      )
      np.testing.assert_allclose(
        fp8_vars['output_grad_amax_history'],
        amax_history_g,
        rtol=rtol,
        atol=atol,
      )

      np.testing.assert_allclose(fp8_vars['input_scale'][0], scale_x)
      np.testing.assert_allclose(fp8_vars['kernel_scale'][0], scale_k)
      np.testing.assert_allclose(fp8_vars['output_grad_scale'][0], scale_g)

  @parameterized.parameters({'use_jit': True}, {'use_jit': False})
  def test_fp8_meta_dtype(self, use_jit):
    f32 = jnp.dtype('float32')
    e4m3_max = 448
    config = fp8jax.Fp8Config(selective=False, amax_history_length=3)
    fixed = dict(kernel_amax_history=jnp.zeros((3,)), kernel_scale=jnp.ones((1,)),
                 output_grad_amax_history=jnp.zeros((3,)), output_grad_scale=jnp.ones((1,)),
                 nonfinite_count=jnp.zeros((1,)))
    eye = jnp.eye(16, dtype=f32)

    # Create a scan loop with reused ah_f32 and sf_f32. So, the autograd will
    # accumulate the grads of them. We expect the max op (rather than add op)
    # for the accumulation (fp8jax's op converts them to its max-grad dtype).
    def outer(x, ah_f32, sf_f32):
      op = fp8jax.Fp8DotGeneral.from_state(
        config, dict(fixed, input_amax_history=ah_f32, input_scale=sf_f32))
      array_x = jnp.full((16, 16), x, f32)
      def body_fun(carry, _):
        carry = op(carry, eye, (((1,), (0,)), ((), ())))
        return carry, None
      array_x, _ = jax.lax.scan(body_fun, array_x, None, length=3)
      return array_x[0, 0]

    outer_fn = jax.grad(outer, (0, 1, 2))
    if use_jit:
      outer_fn = jax.jit(outer_fn)
    ah = jnp.array([0., 0., 0.], f32)
    sf = jnp.array([1.], f32)
    # 1st iteration
    grads, new_ah, new_sf = outer_fn(2.0, ah, sf)
    np.testing.assert_allclose(new_ah, [2., 0., 0.])
    np.testing.assert_allclose(new_sf, [1.])
    # 2nd iteration
    grads, new_ah, new_sf = outer_fn(3., new_ah, new_sf)
    np.testing.assert_allclose(new_ah, [3., 0., 2.])
    np.testing.assert_allclose(new_sf, [2. / e4m3_max])
    # 3rd iteration
    grads, new_ah, new_sf = outer_fn(4., new_ah, new_sf)
    np.testing.assert_allclose(new_ah, [4., 2., 3.])
    np.testing.assert_allclose(new_sf, [3. / e4m3_max])
