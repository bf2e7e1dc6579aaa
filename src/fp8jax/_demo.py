"""A short demo: convert a small equinox MLP to FP8, train it next to its bf16 twin,
and show which layers and GEMMs run in FP8.

    fp8jax-demo            # or: python -m fp8jax._demo [--steps 100] [--width 256]

Runs on the CPU in under a minute (FP8 is simulated there: the GEMMs are upcast);
on a Hopper GPU the report shows cuBLASLt FP8 GEMMs.
"""

from __future__ import annotations

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import fp8jax


def make_data(key, n=2048, dim=64):
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (n, dim))
    w = jax.random.normal(kw, (dim, dim)) / jnp.sqrt(dim)
    return x, jnp.sin(2.0 * x @ w)


def train(model, data, steps, batch=256, lr=2e-3):
    x, y = data
    opt = optax.adamw(lr)
    opt_state = opt.init(fp8jax.trainable(model))

    def loss_fn(model, xb, yb):
        pred = model(xb.astype(jnp.bfloat16)).astype(jnp.float32)
        return jnp.mean((pred - yb) ** 2)

    @eqx.filter_jit
    def step(model, opt_state, xb, yb):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, xb, yb)
        model, opt_state = fp8jax.optax_step(opt, model, grads, opt_state)
        return model, opt_state, loss

    losses = []
    for i in range(steps):
        j = (i * batch) % x.shape[0]
        model, opt_state, loss = step(model, opt_state, x[j : j + batch], y[j : j + batch])
        losses.append(float(loss))
    return model, losses


class MLP(eqx.Module):
    """Three bf16 linear layers with GELU; takes [batch, dim]."""

    layers: tuple

    def __init__(self, dim, width, key):
        keys = jax.random.split(key, 3)
        sizes = [(dim, width), (width, width), (width, dim)]
        self.layers = tuple(
            eqx.nn.Linear(i, o, dtype=jnp.bfloat16, key=k)
            for (i, o), k in zip(sizes, keys, strict=True)
        )

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.gelu(jax.vmap(layer)(x))
        return jax.vmap(self.layers[-1])(x)


def main(argv=None) -> None:
    """Console entry point (``fp8jax-demo``)."""
    run(argv)


def run(argv=None) -> dict:
    """Run the demo; return ``{precision: (losses, seconds)}``."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps} is not allowed; expected an int >= 1")
    if args.width < 16 or args.width % 16:
        parser.error(
            f"--width {args.width} is not allowed; expected a positive multiple of 16 "
            "(FP8 GEMM dims must be)"
        )
    key = jax.random.PRNGKey(0)
    data = make_data(key)
    model = MLP(64, args.width, key)
    # Toy sizes: turn the "only where FP8 pays off" policy off so every layer converts.
    fp8_model, report = fp8jax.fp8_linear_layers(
        model, fp8jax.Fp8Config(selective=False), return_report=True
    )
    print(report, "\n")
    print(
        fp8jax.fp8_gemm_report(
            lambda m, x: m(x),
            fp8_model,
            data[0][:256].astype(jnp.bfloat16),
            stage="lowered" if jax.devices()[0].platform == "cpu" else "compiled",
        ),
        "\n",
    )
    results = {}
    for name, m in (("bf16", model), ("fp8", fp8_model)):
        t0 = time.perf_counter()
        trained, losses = train(m, data, args.steps)
        results[name] = (losses, time.perf_counter() - t0)
        print(
            f"{name}: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps "
            f"({results[name][1]:.1f} s)"
        )
    gap = abs(results["fp8"][0][-1] - results["bf16"][0][-1]) / results["bf16"][0][-1]
    print(f"final-loss gap fp8 vs bf16: {100 * gap:.2f}%")
    first = fp8jax.fp8_state(trained)[0][1]
    print(
        f"layer 0 FP8 state after training: input_scale={float(first.input_scale[0]):.4g}, "
        f"output_grad_scale={float(first.output_grad_scale[0]):.4g}, "
        f"nonfinite_count={int(first.nonfinite_count[0])}"
    )
    return results


if __name__ == "__main__":
    main()
