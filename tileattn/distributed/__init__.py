"""Context parallelism: one sequence split across the ranks of a group, exact ring attention.

```python
import tileattn.distributed as td
group = td.init()                                     # under mpiexec: MPI (+ NCCL for CuPy)
q_local = td.shard(q, group, layout="zigzag")         # this rank's rows of axis -2
o, lse = td.forward(q_local, k_local, v_local, group=group, layout="zigzag", causal=True,
                    return_lse=True)
dq, dk, dv = td.backward(do_local, q_local, k_local, v_local, o, lse, group=group,
                         layout="zigzag", causal=True)
o_full = td.unshard(o, group, layout="zigzag")        # gather, for tests and small outputs
```

See SPEC "Context parallelism". `import tileattn.distributed` imports neither mpi4py nor
CuPy: `init()` imports mpi4py, and CuPy is used only for CuPy arrays.
"""

from __future__ import annotations

from .groups import init, simulate
from .layouts import (
    LAYOUTS,
    array_module,
    check_divisible,
    check_layout,
    contiguous,
    empty_like_shape,
    put_rows,
    segments,
    take_rows,
)
from .ring import ring_backward, ring_forward

__all__ = ["LAYOUTS", "backward", "forward", "init", "shard", "simulate", "unshard"]


def shard(x, group, layout: str = "zigzag", axis: int = -2):
    """This rank's rows of `x` along `axis` (the sequence axis, -2 for q/k/v/o; -1 for lse).

    ``"contiguous"``: rows ``[r N/P, (r+1) N/P)``; ``"zigzag"``: chunks ``r`` and ``2P-1-r``
    of ``2P`` equal chunks, in that order. `x` is the whole array (the same on every rank);
    the result is a new C-contiguous array of ``N/P`` rows. A ValueError naming the layout
    when N does not divide into P (contiguous) or 2P (zigzag) chunks.
    """
    check_layout(layout)
    _check_axis("shard", x, axis)
    n_total = x.shape[axis]
    n_local = check_divisible(n_total, layout, group.size)
    rows = [(seg.global_start, seg.length)
            for seg in segments(layout, group.rank, group.size, n_local)]
    return take_rows(x, rows, axis)


def _check_axis(function: str, x, axis) -> None:
    """An axis that `x` has (an int in [-ndim, ndim)), else a ValueError naming it."""
    ndim = len(x.shape)
    if isinstance(axis, bool) or not isinstance(axis, int) or not -ndim <= axis < ndim:
        raise ValueError(f"tileattn.distributed.{function}: axis={axis!r} is not an axis of "
                         f"an array with {ndim} dimensions (shape {tuple(x.shape)})")


def unshard(x_local, group, layout: str = "zigzag", axis: int = -2):
    """The whole array, gathered on every rank from each rank's `x_local` (`shard`'s
    inverse). It passes the shards around the ring (P - 1 shifts), so it holds the whole
    array: meant for tests and small outputs."""
    check_layout(layout)
    _check_axis("unshard", x_local, axis)
    x_local = contiguous(x_local)
    n_local = x_local.shape[axis]
    descriptions = group.allgather((tuple(x_local.shape), str(x_local.dtype)))
    if any(d != descriptions[0] for d in descriptions):
        shown = ", ".join(f"rank {rank}: shape {d[0]} dtype {d[1]}"
                          for rank, d in enumerate(descriptions))
        raise ValueError(f"tileattn.distributed.unshard: every rank must pass a shard of the "
                         f"same shape and dtype, got {shown}")
    if layout == "zigzag" and n_local % 2:
        raise ValueError(f"layout='zigzag' needs an even number of local rows, got {n_local}")
    memory = "host" if array_module(x_local).__name__ == "numpy" else "cuda"
    transport = group.transport(memory, x_local)
    shape = list(x_local.shape)
    shape[axis] = n_local * group.size
    whole = empty_like_shape(x_local, tuple(shape), x_local.dtype)
    piece = x_local
    for step in range(group.size):
        source = (group.rank - step) % group.size
        pending = transport.shift([piece]) if step + 1 < group.size else None
        for seg in segments(layout, source, group.size, n_local):
            put_rows(whole, piece, seg.global_start, seg.local_start, seg.length, axis)
        if pending is not None:
            piece = pending.wait()[0]
    return whole


def _options(scale, softcap, alibi_slopes, dropout_p, seed, block_q, block_k):
    return {"scale": scale, "softcap": softcap, "alibi_slopes": alibi_slopes,
            "dropout_p": dropout_p, "seed": seed, "block_q": block_q, "block_k": block_k}


def forward(q, k, v, *, group, layout="zigzag", causal=False, window=None, scale=None,
            softcap=None, alibi_slopes=None, dropout_p=0.0, seed=None, block_q=None,
            block_k=None, backend="auto", return_lse=False):
    """`tileattn.forward` of a sequence sharded across `group` along axis -2.

    Parameters
    ----------
    q : array, (*batch, Hq, Nq/P, D): this rank's shard (`shard`) of the queries
    k, v : arrays, (*batch, Hkv, Nk/P, D) and (*batch, Hkv, Nk/P, Dv): its shards of K, V
    group : from `init` (or `simulate`)
    layout : {"zigzag", "contiguous"}, the layout the shards were cut with
    causal, window, scale, softcap, alibi_slopes, dropout_p, seed, block_q, block_k, backend
        As `tileattn.forward`, meaning the whole sequence: masks, ALiBi and dropout use
        global row and key positions (``Nq = P * local rows``), so the gathered result is
        `tileattn.forward`'s on the whole arrays to rounding, and dropout keeps the same
        entries bit for bit. Arrays are "bhsd" (the sequence axis is -2).

    Every rank must pass arrays of the same shapes and dtype and the same options: that is
    checked first with one small all-gather, and a rank that disagrees or whose arguments
    are invalid makes every rank raise the same ValueError (no rank hangs).

    Returns
    -------
    o : (*batch, Hq, Nq/P, Dv), dtype of q: this rank's rows of the output
    lse : (*batch, Hq, Nq/P), float32 (float64 for float64 inputs); if `return_lse`
    """
    return ring_forward(group, q, k, v, layout=layout, causal=causal, window=window,
                        backend=backend, return_lse=return_lse,
                        options=_options(scale, softcap, alibi_slopes, dropout_p, seed,
                                         block_q, block_k))


def backward(do, q, k, v, o, lse, *, group, layout="zigzag", causal=False, window=None,
             scale=None, softcap=None, alibi_slopes=None, dropout_p=0.0, seed=None,
             block_q=None, block_k=None, backend="auto", deterministic=True):
    """`tileattn.backward` of a sequence sharded across `group`: pass this rank's shards and
    its rows of `forward`'s ``o`` and ``lse``, with the same options.

    Returns
    -------
    dq, dk, dv : this rank's rows of the gradients (shapes and dtypes of its q, k, v). The
        ``dk``/``dv`` of a rank's K/V shard sum the shares of every rank's queries (they
        travel the ring with the K/V); ``dq`` never leaves its rank.
    """
    options = _options(scale, softcap, alibi_slopes, dropout_p, seed, block_q, block_k)
    options["deterministic"] = deterministic
    return ring_backward(group, do, q, k, v, o, lse, layout=layout, causal=causal,
                         window=window, backend=backend, options=options)
