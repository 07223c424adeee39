"""JAX adapter: ``tileattn.jax.attention(q, k, v, ...)`` with a custom VJP.

Optional: importing this module imports JAX (``import tileattn`` never does). Both passes
run through `jax.pure_callback`, so the function works under `jax.jit` and `jax.grad`; the
callback receives host (NumPy) arrays and runs tileattn's host backend (``backend="auto"``
picks the CPU backend). Options are static: changing them retraces.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from . import api
from .reference import lse_dtype
from .validation import check_layout


def _shapes(q, v, layout):
    o_shape = q.shape[:-1] + (v.shape[-1],)
    lse_shape = q.shape[:-1]
    if layout == "bshd" and q.ndim >= 3:  # lse is (*batch, H, N) in both layouts
        lse_shape = lse_shape[:-2] + (lse_shape[-1], lse_shape[-2])
    return (jax.ShapeDtypeStruct(o_shape, q.dtype),
            jax.ShapeDtypeStruct(lse_shape, lse_dtype(q.dtype)))


def _host_forward(options, q, k, v):
    o, lse = api.forward(np.asarray(q), np.asarray(k), np.asarray(v), return_lse=True,
                         **options)
    return o, lse


def _host_backward(options, do, q, k, v, o, lse):
    return api.backward(*(np.asarray(a) for a in (do, q, k, v, o, lse)), **options)


def _options_dict(frozen):
    options = dict(frozen)
    if options.get("alibi_slopes") is not None:
        options["alibi_slopes"] = np.asarray(options["alibi_slopes"])
    return options


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, frozen_options):
    return _forward_rule(q, k, v, frozen_options)[0]


def _forward_rule(q, k, v, frozen_options):
    forward_options = {key: value for key, value in _options_dict(frozen_options).items()
                       if key != "deterministic"}
    o, lse = jax.pure_callback(partial(_host_forward, forward_options),
                               _shapes(q, v, forward_options["layout"]), q, k, v)
    return o, (q, k, v, o, lse)


def _backward_rule(frozen_options, residuals, do):
    q, k, v, o, lse = residuals
    shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k, v))
    return jax.pure_callback(partial(_host_backward, _options_dict(frozen_options)), shapes,
                             do.astype(o.dtype), q, k, v, o, lse)


_attention.defvjp(_forward_rule, _backward_rule)


def attention(q, k, v, *, causal=False, window=None, scale=None, softcap=None,
              alibi_slopes=None, dropout_p=0.0, seed=None, block_q=None, block_k=None,
              backend="auto", deterministic=True, layout="bhsd"):
    """Differentiable `tileattn.forward` on JAX arrays ``(*batch, H, N, D)``, or
    ``(*batch, N, H, D)`` with ``layout="bshd"`` (flash-attn's layout).

    Same options as `tileattn.forward` (`deterministic` applies to the backward pass);
    returns ``o`` as a JAX array of q's dtype, in q's layout.
    """
    check_layout(layout)  # before tracing: the callbacks' result shapes depend on it
    if alibi_slopes is not None:
        alibi_slopes = _freeze(np.asarray(alibi_slopes, dtype=np.float64).tolist())
    frozen = tuple(sorted(dict(
        causal=causal, window=None if window is None else tuple(window), scale=scale,
        softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed,
        block_q=block_q, block_k=block_k, backend=backend, deterministic=deterministic,
        layout=layout,
    ).items()))
    return _attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), frozen)


def _freeze(value):
    """Nested lists as nested tuples, so options are hashable for `nondiff_argnums`."""
    return tuple(_freeze(v) for v in value) if isinstance(value, (list, tuple)) else value
