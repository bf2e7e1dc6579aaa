"""The mixture-of-experts layer: `MoE` (router, top-k, the experts as a `GroupedMLP`, and
the permutation into and out of the grouped layout) and the `RoutingInfo` it returns."""

from __future__ import annotations

import math
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .. import _checks as checks
from .. import _state
from .._config import Fp8Config
from .._ops import group_layout as gl
from .._ops import grouped as gr
from .._ops import token_dispatch as td
from ._grouped import F32, GroupedMLP, _check_backend, row_align


class RoutingInfo(eqx.Module):
    """What the router decided for one batch (returned by `MoE` for logging/losses).

    Arguments:
        load_balancing_loss: Switch/GShard's auxiliary loss (a scalar).
        router_z_loss: ST-MoE's router z-loss (a scalar).
        tokens_per_expert: the assignments each expert got, ``[experts]``.
        dropped_fraction: the share of assignments dropped by the capacity (0 if dropless).
    """

    load_balancing_loss: Float[Array, ""]
    router_z_loss: Float[Array, ""]
    tokens_per_expert: Int[Array, " experts"]
    dropped_fraction: Float[Array, ""]


class MoE(eqx.Module):
    """Mixture-of-experts feed-forward layer (Mixtral / Switch / Megatron style).

    ``x [..., hidden]`` -> ``(y [..., hidden], RoutingInfo)``. Steps: router
    (``hidden -> num_experts`` linear in float32, softmax or sigmoid scores), top-k,
    token permutation into the padded expert layout (sorted by expert, stable: ties
    in the scores go to the lower expert index, as ``jax.lax.top_k`` orders them; the
    earlier token wins a capacity slot), `GroupedMLP`, un-permutation weighted by the
    routing weights.

    ``capacity_factor``: ``None`` (dropless) or the factor ``c`` of Switch: each
    expert keeps at most ``ceil(c * tokens * top_k / num_experts)`` assignments and
    the rest are dropped (their weight is 0; the residual path carries the token).
    ``normalize_weights``: rescale the top-k weights to sum to 1 (Mixtral).
    ``dispatch``: with the experts sharded (`fp8jax.shard_model`'s ``expert_axis``),
    ``"replicated"`` runs each device's experts on every token (rows whole on each device,
    outputs summed over the axis); ``"all_to_all"`` (the default: it moves each row only
    where it is needed, see benchmarks/RESULTS.md) splits the tokens over the devices and
    sends each row only to its experts' device and back (`fp8jax._ops.token_dispatch`), in
    ``dispatch_dtype``: ``"fp8"`` (e4m3 rows: to per-tensor FP8 experts, the default
    recipe, cast once with fc1's own input scale and taken by fc1 as they arrive, so they
    round once, as on one device; otherwise one float32 scale per row, cast again by the
    experts), ``"bf16"``, or ``"auto"`` (FP8 for FP8 experts); the outputs come back in
    bf16. There the capacity counts each device's own tokens, and the tokens must divide
    over the mesh's devices. Without sharded experts both run alike.
    The load-balancing loss is Switch/GShard's ``E * sum_e f_e * P_e`` (``f_e``: share
    of assignments sent to ``e``, ``P_e``: mean router probability of ``e``); the
    router z-loss (ST-MoE) is ``mean(logsumexp(logits)^2)``. Add them to the loss with
    your coefficients.

    Arguments:
        hidden, ffn, num_experts: model width, each expert's inner size, the experts.
        key: initialises the router and the experts.
        top_k: experts per token.
        activation: a name in `ACTIVATIONS`.
        score: ``"softmax"`` or ``"sigmoid"`` router scores.
        capacity_factor: None (dropless) or Switch's capacity factor.
        normalize_weights: rescale the top-k weights to sum to 1.
        fp8: FP8 expert GEMMs (the router stays float32).
        config: the `Fp8Config` (None: the default one).
        dtype: the experts' weights' dtype.
        backend: ``"auto"``, ``"pallas"`` or ``"reference"``.
        dispatch: ``"all_to_all"`` (default) or ``"replicated"`` (expert parallelism only).
        dispatch_dtype: ``"auto"``, ``"fp8"`` or ``"bf16"`` (the all-to-all's payload).
    """

    router: Float[Array, "hidden experts"]
    experts: GroupedMLP
    top_k: int = eqx.field(static=True)
    score: str = eqx.field(static=True)
    capacity_factor: float | None = eqx.field(static=True)
    normalize_weights: bool = eqx.field(static=True)
    dispatch: str = eqx.field(static=True, default="all_to_all")
    dispatch_dtype: str = eqx.field(static=True, default="auto")

    def __init__(
        self,
        hidden: int,
        ffn: int,
        num_experts: int,
        *,
        key: PRNGKeyArray,
        top_k: int = 2,
        activation: str = "swiglu",
        score: Literal["softmax", "sigmoid"] = "softmax",
        capacity_factor: float | None = None,
        normalize_weights: bool = True,
        fp8: bool = True,
        config: Fp8Config | None = None,
        dtype=F32,
        backend: str = "auto",
        dispatch: Literal["replicated", "all_to_all"] = "all_to_all",
        dispatch_dtype: Literal["auto", "fp8", "bf16"] = "auto",
    ):
        hidden = checks.count("MoE", "hidden", hidden)
        ffn = checks.count("MoE", "ffn", ffn)
        num_experts = checks.count("MoE", "num_experts", num_experts)
        backend = _check_backend("MoE", backend)
        config = checks.config("MoE", config)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(
                f"MoE: top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}"
            )
        if dispatch not in ("replicated", "all_to_all"):
            raise ValueError(
                f"MoE: dispatch must be 'replicated' or 'all_to_all', got {dispatch!r}"
            )
        if dispatch_dtype not in ("auto", "fp8", "bf16"):
            raise ValueError(
                f"MoE: dispatch_dtype must be 'auto', 'fp8' or 'bf16', got {dispatch_dtype!r}"
            )
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"MoE: score must be 'softmax' or 'sigmoid', got {score!r}")
        number = isinstance(
            capacity_factor, (int, float, np.integer, np.floating)
        ) and not isinstance(capacity_factor, bool)
        if capacity_factor is not None and not (number and capacity_factor > 0):
            raise ValueError(f"MoE: capacity_factor must be > 0 or None, got {capacity_factor!r}")
        k_router, k_experts = jax.random.split(key)
        self.router = jax.random.normal(k_router, (hidden, num_experts), F32) * (
            1.0 / math.sqrt(hidden)
        )
        self.experts = GroupedMLP(
            num_experts,
            hidden,
            ffn,
            key=k_experts,
            activation=activation,
            fp8=fp8,
            config=config,
            dtype=dtype,
            backend=backend,
        )
        self.top_k, self.score = top_k, score
        self.capacity_factor = None if capacity_factor is None else float(capacity_factor)
        self.normalize_weights = normalize_weights
        self.dispatch, self.dispatch_dtype = dispatch, dispatch_dtype

    @property
    def num_experts(self) -> int:
        return int(self.router.shape[-1])

    def capacity(self, num_tokens: int) -> int | None:
        """Assignments each expert keeps of ``num_tokens`` tokens (None: dropless); with the
        all-to-all dispatch, of each device's tokens."""
        if self.capacity_factor is None:
            return None
        return max(1, math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts))

    @jax.named_scope("fp8jax.nn.MoE")
    def __call__(self, x: Float[Array, "... hidden"]) -> tuple[Array, RoutingInfo]:
        x = checks.float_array("MoE", "x", x)
        hidden = self.router.shape[0]
        if x.ndim == 0 or x.shape[-1] != hidden:
            raise ValueError(f"MoE: x must have shape (..., {hidden}), got {x.shape}")
        lead = x.shape[:-1]
        tokens = x.reshape(-1, hidden)
        y, info = self._route_and_run(tokens)
        return y.reshape(lead + (hidden,)), info

    def _route_and_run(self, tokens):
        num_tokens, g, k = tokens.shape[0], self.num_experts, self.top_k
        logits = jnp.dot(tokens.astype(F32), self.router)
        probs = (
            jax.nn.softmax(logits, axis=-1) if self.score == "softmax" else jax.nn.sigmoid(logits)
        )
        sharding = self.experts.fc1.expert_sharding
        if self.dispatch != "all_to_all":
            sharding = None  # the experts see every row, on each device
        if sharding is not None and num_tokens % sharding.mesh.size:
            raise ValueError(
                f"MoE: dispatch='all_to_all' (the default with sharded experts) splits the "
                f"tokens over the mesh's {sharding.mesh.size} devices; {num_tokens} tokens do "
                "not divide. Pad the batch, or build the MoE with dispatch='replicated'."
            )
        # ties: lower expert index first
        weights, experts = (
            jax.lax.top_k(probs, k) if sharding is None else td.top_k(sharding, probs, k)
        )
        if self.normalize_weights and (k > 1 or self.score == "sigmoid"):
            weights = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1e-20)

        flat_expert = experts.reshape(-1).astype(jnp.int32)  # [A] assignments, token-major
        num_assign = flat_expert.shape[0]
        counts = jnp.bincount(flat_expert, length=g).astype(jnp.int32)
        if sharding is not None:
            gathered, kept, kept_sizes = self._run_all_to_all(tokens, experts, sharding)
        else:
            gathered, kept, kept_sizes = self._run_replicated(tokens, flat_expert, counts)
        w = jnp.where(kept, weights, 0.0).astype(gathered.dtype)
        y = jnp.einsum("tk,tkh->th", w, gathered, preferred_element_type=F32).astype(tokens.dtype)

        share = counts.astype(F32) / num_assign
        mean_prob = jnp.mean(
            probs if self.score == "softmax" else probs / jnp.sum(probs, -1, keepdims=True), axis=0
        )
        info = RoutingInfo(
            load_balancing_loss=g * jnp.sum(share * mean_prob),
            router_z_loss=jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1))),
            tokens_per_expert=kept_sizes,
            dropped_fraction=(num_assign - jnp.sum(kept_sizes)).astype(F32) / num_assign,
        )
        return y, info

    def _run_all_to_all(self, tokens, experts, sharding: gr.ExpertSharding):
        """The experts on the rows sent to their devices (`fp8jax._ops.token_dispatch`):
        ``([T, k, H] outputs, [T, k] kept, [G] kept assignments per expert)``."""
        num_tokens, k = experts.shape
        devices = sharding.mesh.size
        fp8 = self.dispatch_dtype == "fp8" or (
            self.dispatch_dtype == "auto" and self.experts.fc1.fp8_state is not None
        )
        align = row_align(self.experts.fc1, num_tokens * k // devices)
        cap = self.capacity(num_tokens // devices)
        precast = self._precast() if fp8 else None
        plan = td.dispatch(sharding, tokens, experts, self.num_experts, cap, align, fp8, precast)
        y_pad = self.experts.apply_padded(plan.rows, plan.layout, plan.precast)
        gathered = td.combine(sharding, y_pad, plan, k)
        kept = plan.kept().reshape(num_tokens, k)
        return gathered, kept, jnp.sum(plan.kept_sizes, axis=0)

    def _precast(self) -> td.Precast | None:
        """fc1's input cast for the FP8 dispatch, where fc1 scales its input per tensor: the
        rows then cross cast once, with fc1's own scale (else per-row scales, None)."""
        state = self.experts.fc1.fp8_state
        if state is None or not state.config.recipe.per_tensor_scale:
            return None
        cfg = state.config
        return td.Precast(
            lambda amax, s, h: gr.input_scale(cfg, amax, s, h),
            _state.values((state.input_scale, state.input_amax_history)),
            cfg.input_dtype,
        )

    def _run_replicated(self, tokens, flat_expert, counts):
        """The experts on the padded layout of every row (``_run_all_to_all``'s outputs)."""
        num_tokens, g, k = tokens.shape[0], self.num_experts, self.top_k
        num_assign = flat_expert.shape[0]
        order = jnp.argsort(flat_expert, stable=True)
        sorted_expert = flat_expert[order]
        starts_unpadded = jnp.cumsum(counts) - counts
        rank = jnp.arange(num_assign, dtype=jnp.int32) - starts_unpadded[sorted_expert]
        cap = self.capacity(num_tokens)
        align = row_align(self.experts.fc1, num_assign)
        if cap is None:
            kept_sizes, keep_sorted = counts, jnp.ones((num_assign,), bool)
            rows = gr.padded_rows(num_assign, g, align)
        else:
            kept_sizes, keep_sorted = jnp.minimum(counts, cap), rank < cap
            rows = min(gr.padded_rows(num_assign, g, align), g * gl._round_up(cap, align))
        layout = gr.layout_from_sizes(kept_sizes, rows, align)

        big = gl._BIG
        pos_sorted = jnp.where(keep_sorted, layout.starts[sorted_expert] + rank, big)
        pos = (
            jnp.zeros((num_assign,), jnp.int32).at[order].set(pos_sorted)
        )  # padded row of each assignment
        token_of_row = (
            jnp.full((rows,), num_tokens, jnp.int32)
            .at[pos]
            .set(jnp.arange(num_assign, dtype=jnp.int32) // k, mode="drop")
        )
        x_pad = jnp.take(tokens, token_of_row, axis=0, mode="fill", fill_value=0)
        y_pad = self.experts.apply_padded(x_pad, layout)
        kept = (pos < big).reshape(num_tokens, k)
        gathered = jnp.take(y_pad, pos, axis=0, mode="fill", fill_value=0).reshape(
            num_tokens, k, -1
        )
        return gathered, kept, kept_sizes
