"""The programs `benchmarks.compile` runs, one fresh process per variant: `HEADER` (imports,
the arguments: model, precision, quick, cache directory), one `MODELS` entry (a notebook's
or the README's step as a user writes it, beside the same step in bf16) and `TAIL` (lower,
compile, time a few steps, print one JSON line)."""

# One process: build one model's step, lower + compile it, time a few steps, print JSON.
# Each model is a notebook's (or the README's) FP8 step as a user writes it, beside the
# same step in bf16 (``fp8`` False); ``quick`` picks CPU-sized shapes.
HEADER = """
import json, re, statistics, sys, time
import jax, jax.numpy as jnp, equinox as eqx, optax, fp8jax
name, precision, quick, cache = globals().get("ARGV", sys.argv)[1:5]
quick = quick == "1"
if cache != "-":
    fp8jax.enable_compilation_cache(cache)
fp8 = precision == "fp8"
keys = jax.random.split(jax.random.PRNGKey(0), 4)
bf16 = jnp.bfloat16

def adam_step(opt, loss_fn):
    @eqx.filter_jit
    def step(model, opt_state, *data):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, *data)
        model, opt_state = fp8jax.optax_step(opt, model, grads, opt_state)
        return model, opt_state, loss
    return step
"""

MODELS = {
    # issue 21's user model: two 4096 -> 14336 -> 4096 gelu blocks, 16384 tokens, adamw
    "two-block": """
dim, hidden, tokens = (64, 128, 64) if quick else (4096, 14336, 16384)
model = [eqx.nn.Linear(i, o, key=k, dtype=bf16)
         for (i, o), k in zip([(dim, hidden), (hidden, dim)] * 2, keys)]
if fp8:
    model = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(selective=False))
opt = optax.adamw(1e-4)

def loss_fn(model, x):
    for up, down in (model[:2], model[2:]):
        x = x + jax.vmap(down)(jax.nn.gelu(jax.vmap(up)(x)))
    return jnp.mean(x.astype(jnp.float32) ** 2)

step = adam_step(opt, loss_fn)
args = (model, opt.init(fp8jax.trainable(model)),
        jax.random.normal(keys[3], (tokens, dim), bf16))
""",
    # notebooks/01_quickstart.ipynb (and the README's quickstart)
    "quickstart": """
width, tokens = (64, 256) if quick else (4096, 8192)
model = eqx.nn.MLP(width, width, width_size=width, depth=2, key=keys[0])
model = jax.tree_util.tree_map(lambda a: a.astype(bf16) if eqx.is_inexact_array(a) else a, model)
if fp8:
    model = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(selective=not quick))
opt = optax.adam(1e-3)
x = jax.random.normal(keys[1], (tokens, width), bf16)
loss_fn = lambda m, x, y: jnp.mean((jax.vmap(m)(x).astype(jnp.float32) - y) ** 2)
step = adam_step(opt, loss_fn)
args = (model, opt.init(fp8jax.trainable(model)), x, jnp.sin(x))
""",
    # notebooks/04_fused_mlp.ipynb: FusedMLP's gradient (bf16: the unfused bf16 block)
    "fused-mlp": """
from fp8jax.nn import FusedMLP
hidden, ffn, tokens = (64, 128, 256) if quick else (4096, 14336, 8192)
model = FusedMLP(hidden, ffn, activation="swiglu", norm="rmsnorm", residual=True,
                 config=fp8jax.Fp8Config(selective=not quick), fp8=fp8, fused=fp8,
                 dtype=bf16, key=keys[0])
step = eqx.filter_jit(eqx.filter_grad(lambda m, x: jnp.sum(m(x).astype(jnp.float32) ** 2)))
args = (model, jax.random.normal(keys[1], (tokens, hidden), bf16))
""",
    # notebooks/05_attention.ipynb: MultiHeadAttention's train step (fp8_mha against bf16)
    "mha": """
from fp8jax.nn import MultiHeadAttention
batch, seq, heads, kv_heads, head_dim = (2, 128, 4, 2, 32) if quick else (4, 8192, 16, 8, 128)
dim = heads * head_dim
model = MultiHeadAttention(dim, heads, num_kv_heads=kv_heads, mode="fp8_mha" if fp8 else "bf16",
                           backend="reference" if quick else "auto",
                           config=fp8jax.Fp8Config(selective=not quick), dtype=bf16, key=keys[0])
opt = optax.adam(1e-3)
loss_fn = lambda m, x, t: jnp.mean((m(x) - t).astype(jnp.float32) ** 2)
step = adam_step(opt, loss_fn)
args = (model, opt.init(fp8jax.trainable(model)),
        jax.random.normal(keys[1], (batch, seq, dim), bf16),
        jax.random.normal(keys[2], (batch, seq, dim), bf16))
""",
    # notebooks/06_moe.ipynb: the MoE train step (grouped FP8 experts against bf16)
    "moe": """
from fp8jax.nn import MoE
hidden, ffn, tokens = (64, 128, 256) if quick else (1024, 2048, 8192)
model = MoE(hidden, ffn, 8, key=keys[0], top_k=2, activation="swiglu", dtype=bf16, fp8=fp8)
opt = optax.adam(3e-3)

def loss_fn(m, x, t):
    y, info = m(x)
    return jnp.mean((y - t).astype(jnp.float32) ** 2) + 1e-2 * info.load_balancing_loss

step = adam_step(opt, loss_fn)
x = jax.random.normal(keys[1], (tokens, hidden), bf16)
args = (model, opt.init(fp8jax.trainable(model)), x, jnp.tanh(x))
""",
    # notebooks/07_sharded.ipynb: the small gelu MLP on a mesh of every local device
    "sharded": """
dim, hidden, batch = 64, 256, 128
model = eqx.nn.MLP(dim, dim, width_size=hidden, depth=2, activation=jax.nn.gelu, key=keys[0])
if fp8:
    model = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(selective=False))
n = jax.device_count()
mesh = jax.make_mesh((1, n), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
model = fp8jax.shard_model(model, mesh)
x = jax.random.normal(keys[1], (batch, dim)) * 3.0
opt = optax.adam(1e-2)
step = adam_step(opt, lambda m, x, y: jnp.mean((jax.vmap(m)(x) - y) ** 2))
args = (model, opt.init(fp8jax.trainable(model)), x, jnp.sin(x))
""",
}
# The 1b trainer's step (notebook 02) compiled in this process from abstract shapes: no
# weights, data or steps, so it takes a fraction of ``1b-trainer``'s time; with the HLO counts
# of every record, a quick check of what a change does to the compiled program.
MODELS["1b-step"] = """
from fp8jax.train import _config as train_config
from fp8jax.train._trainer import make_train_step
run = train_config.RunConfig(**train_config.PRESETS["tiny" if quick else "1b"])
is_leaf = lambda x: isinstance(x, (jax.Array, jax.ShapeDtypeStruct))
model = eqx.filter_eval_shape(train_config.build_model, run, precision)
params, static = eqx.partition(model, is_leaf)
opt = train_config.make_optimizer(run)
opt_state = jax.eval_shape(lambda p: opt.init(fp8jax.trainable(eqx.combine(p, static))), params)
step = jax.jit(make_train_step(opt, static), donate_argnums=(0, 1))
args = (params, opt_state, jax.ShapeDtypeStruct((run.batch, run.model.seq + 1), jnp.int32))
runnable = False  # abstract arguments: compiled, not run
"""

# notebooks/08_recipes.ipynb: one linear's train step per recipe (8192^3)
RECIPE = """
M, K, N = (256, 256, 128) if quick else (8192, 8192, 8192)
model = eqx.nn.Linear(K, N, use_bias=False, dtype=bf16, key=keys[0])
if fp8:
    model = fp8jax.fp8_linear_layers(model, fp8jax.Fp8Config(recipe=RECIPE, selective=False))
apply = lambda m, x: jax.vmap(m)(x) if isinstance(m, eqx.nn.Linear) else m(x)
loss = lambda m, x, g: jnp.sum(apply(m, x).astype(jnp.float32) * g)
step = eqx.filter_jit(jax.value_and_grad(loss, argnums=(0, 1)))
args = (model, jax.random.normal(keys[1], (M, K), bf16), jax.random.normal(keys[2], (M, N), bf16))
"""
for _recipe in ("tensor", "rowwise", "blockwise"):
    MODELS[f"recipe-{_recipe}"] = f"RECIPE = {_recipe!r}\n" + RECIPE

TAIL = """
start = time.perf_counter()
lowered = step.lower(*args)
lower_s = time.perf_counter() - start
compiled = lowered.compile()
compile_s = time.perf_counter() - start
report = fp8jax.fp8_gemm_report(compiled)
hlo = (getattr(compiled, "compiled", None) or compiled).as_text()
times = []
for _ in range((3 if quick else 12) if globals().get("runnable", True) else 0):
    t0 = time.perf_counter()
    jax.block_until_ready(step(*args))
    times.append(time.perf_counter() - t0)
print(json.dumps(dict(compile_s=compile_s, lower_s=lower_s,
                      step_ms=1e3 * statistics.median(times[2:]) if times else None,
                      fusions=len(re.findall(r"^\\s*(?:ROOT )?\\S+ = \\S+ fusion\\(", hlo, re.M)),
                      hlo_instructions=len(re.findall(r"^\\s*(?:ROOT )?\\S+ = ", hlo, re.M)),
                      fp8_gemms=sum(g.is_fp8 for g in report.gemms), gemms=len(report.gemms),
                      device=jax.devices()[0].device_kind, platform=jax.devices()[0].platform,
                      jax=jax.__version__)))
"""
