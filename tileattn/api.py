"""The public API: `forward` and `backward`.

Validation happens here once; then one dispatch to the chosen backend, which sees 4-D arrays
and an `AttentionOptions`. Empty problems are answered here so no backend special-cases them.
"""

from __future__ import annotations

from dataclasses import replace
from operator import itemgetter

import numpy as np

from . import arrays, backends
from .reference import lse_dtype
from .problem_cache import dense_call, remembered_problem, validate_call
from .validation import Problem, check_backend_name, check_bool
from .varlen_validation import VARLEN_KEYWORDS

_CAUSAL_PICTURE = """
    Causal mask, bottom-right aligned (Nq=3, Nk=5; 1 = kept)::

        1 1 1 0 0
        1 1 1 1 0
        1 1 1 1 1

    With Nq > Nk the first Nq - Nk rows keep no key: their output is 0 and lse is -inf.
"""


def _resolve_backend(name: str, memory: str):
    name = check_backend_name(name)
    if name == "auto":
        name = backends.choose_auto(memory)
    module = backends.load(name)
    if module.MEMORY == "cuda" and memory != "cuda":
        raise ValueError(f"backend={name!r} needs arrays in GPU memory (CuPy arrays), got "
                         "host (NumPy) arrays; move them with cupy.asarray or use backend='cpu'")
    if module.MEMORY == "host" and memory == "cuda" and name != "reference":
        raise ValueError(f"backend={name!r} needs host (NumPy) arrays, got CuPy arrays; "
                         "use backend='gpu' or move them with cupy.asnumpy")
    return module


_OUTPUT_NAMES = {"forward": ("out", "lse_out"), "backward": ("dq_out", "dk_out", "dv_out")}
# A backend's arrays per pass, in the order it takes them.
_INPUTS = {"forward": itemgetter("q", "k", "v"),
           "backward": itemgetter("do", "q", "k", "v", "o", "lse")}


def _run(module, function_name: str, problem: Problem):
    """Call a backend; the reference backend also serves CUDA arrays through host copies.
    Output buffers go to backends that write into them (``WRITES_OUT``)."""
    tensors = problem.tensors
    layout = problem.layout
    crosses_to_host = module.MEMORY == "host" and layout.memory == "cuda"
    if crosses_to_host:
        tensors = {name: arrays.to_host(a) for name, a in tensors.items()}
    options = problem.options
    if crosses_to_host and options.varlen is not None:  # lengths an unchecked call kept there
        options = replace(options, varlen=options.varlen.on_host())
    buffers = {}
    # Asked only where there is a buffer to pass: a getattr that misses costs ~1 us.
    if ((problem.outputs or layout.sequence_first) and not crosses_to_host
            and getattr(module, "WRITES_OUT", False)):
        buffers = {name: problem.outputs[name] for name in _OUTPUT_NAMES[function_name]
                   if name in problem.outputs}
        if (getattr(module, "STRIDED_OUT", False) and problem.layout.sequence_first
                and not problem.layout.single_head):
            for name, like, width in _RESULT_ROWS[function_name]:
                if name not in buffers:
                    buffers[name] = _sequence_first_buffer(problem, like, width)
    results = getattr(module, function_name)(*_INPUTS[function_name](tensors), options,
                                             **buffers)
    if crosses_to_host:
        results = tuple(arrays.to_device_like(r, problem.tensors["q"]) for r in results)
    return results


# Per pass, the results a backend may write at any strides: (buffer, the input whose batch,
# heads and rows it has, the input whose last axis it has).
_RESULT_ROWS = {"forward": (("out", "q", "v"),),
                "backward": (("dq_out", "q", "q"), ("dk_out", "k", "k"), ("dv_out", "v", "v"))}


def _sequence_first_buffer(problem: Problem, like: str, width: str):
    """For a ``layout="bshd"`` call with a head axis, a result (o, dq, dk or dv) allocated
    in the caller's ``(B, N, H, D)`` order and seen in the backends' ``(B, H, N, D)`` order,
    which a backend that writes strided rows (``STRIDED_OUT``) fills in place: the caller
    gets a contiguous result, as from flash-attn, not a view of a heads-first buffer."""
    rows = problem.tensors[like]
    batch, heads, n = rows.shape[:3]
    return arrays.empty((batch, n, heads, problem.tensors[width].shape[3]), problem.dtype,
                        problem.layout.memory, problem.tensors["q"]).swapaxes(1, 2)


def _fill_outputs(problem: Problem, function_name: str, results: tuple) -> None:
    """Copy each result into its caller's buffer, unless the backend wrote it there."""
    if not problem.outputs:
        return
    for name, result in zip(_OUTPUT_NAMES[function_name], results):
        buffer = problem.outputs.get(name)
        if buffer is not None and result is not buffer:
            buffer[...] = result


def _check_serves(module, problem: Problem) -> None:
    """Variable-length and paged calls need a backend that declares ``VARLEN``."""
    if problem.options.varlen is not None and not getattr(module, "VARLEN", False):
        raise NotImplementedError(
            f"variable-length and paged attention (seqlens_q, seqlens_k, cu_seqlens_q, "
            f"cu_seqlens_k, block_table) is not implemented by the backend module "
            f"{module.__name__}; the 'cpu', 'gpu' and 'reference' backends serve it")


def _length_keywords(seqlens_q, seqlens_k, cu_seqlens_q, cu_seqlens_k, block_table):
    """The length keywords for `validate`, or None for a dense call (the common case, kept
    to a few ``is None`` tests: small calls are counted in microseconds)."""
    if (seqlens_q is None and seqlens_k is None and cu_seqlens_q is None
            and cu_seqlens_k is None and block_table is None):
        return None
    return {"seqlens_q": seqlens_q, "seqlens_k": seqlens_k, "cu_seqlens_q": cu_seqlens_q,
            "cu_seqlens_k": cu_seqlens_k, "block_table": block_table}


def _straight_to_backend(function_name: str, arrays_in: tuple, options: tuple, layout,
                         check_lengths, backend: str):
    """A call without lengths or output buffers: ``(results, None)`` where the problem
    cache remembers its signature (`problem_cache.dense_call`), having run `function_name`
    on the backend as `run_forward` or `run_backward` would, past their steps; else
    ``(None, dense)``, the cache's ``(natives, key)`` for `remembered_problem`."""
    natives, key, template, tensors = dense_call(arrays_in, options, layout, check_lengths)
    if template is not None:
        layout_of = template.layout
        module = _resolve_backend(backend, layout_of.memory)
        # Not the golden model's host copies of CuPy arrays, nor buffers in the caller's
        # order for a backend that writes them (`_run`: a "bshd" o on the GPU). Asked of
        # the module's dict: a getattr that misses costs ~0.5 us.
        if module.MEMORY == layout_of.memory and (
                tensors is natives or not vars(module).get("WRITES_OUT", False)):
            restore, n_q_heads = layout_of.restore, template.n_q_heads
            if function_name == "forward":
                o, lse = module.forward(*tensors, template.options)
                return (restore(o, n_q_heads), restore(lse, n_q_heads, is_lse=True)), None
            q, k, v, do, o, lse = tensors
            dq, dk, dv = module.backward(do, q, k, v, o, lse, template.options)
            n_kv_heads = template.n_kv_heads
            return (restore(dq, n_q_heads), restore(dk, n_kv_heads),
                    restore(dv, n_kv_heads)), None
    return None, (natives, key)


def run_forward(problem: Problem, backend: str):
    """Forward of a validated problem on `backend`: ``(o, lse)`` in "bhsd" order, also
    written into the problem's output buffers. `tileattn.distributed` calls this (and
    `run_backward`) with options placed in a longer sequence (`AttentionOptions.row_offset`)."""
    module = _resolve_backend(backend, problem.layout.memory)
    _check_serves(module, problem)
    if problem.is_empty:
        batch = problem.tensors["q"].shape[0]
        memory, like = problem.layout.memory, problem.tensors["q"]
        o = arrays.full((batch, problem.n_q_heads, problem.n_q, problem.value_dim), 0.0,
                        problem.dtype, memory, like)
        lse = arrays.full((batch, problem.n_q_heads, problem.n_q), -np.inf,
                          lse_dtype(problem.dtype), memory, like)
    else:
        o, lse = _run(module, "forward", problem)
    _fill_outputs(problem, "forward", (o, lse))
    return o, lse


def run_backward(problem: Problem, backend: str):
    """Backward of a validated problem on `backend`: ``(dq, dk, dv)`` in "bhsd" order."""
    module = _resolve_backend(backend, problem.layout.memory)
    _check_serves(module, problem)
    if problem.is_empty:
        memory, tensors = problem.layout.memory, problem.tensors
        dq, dk, dv = (arrays.full(tensors[n].shape, 0.0, problem.dtype, memory, tensors["q"])
                      for n in ("q", "k", "v"))
    else:
        dq, dk, dv = _run(module, "backward", problem)
    _fill_outputs(problem, "backward", (dq, dk, dv))
    return dq, dk, dv


_OPTION_DEFAULTS = (("causal", False), ("window", None), ("scale", None), ("softcap", None),
                    ("alibi_slopes", None), ("dropout_p", 0.0), ("seed", None),
                    ("block_q", None), ("block_k", None), ("deterministic", True))


def replay(function_name: str, arrays: tuple, *, backend="auto", layout="bhsd",
           check_lengths=True, allocate=None, **keywords):
    """For an adapter whose calls repeat one problem on new buffers of the same shapes,
    strides and dtypes (`tileattn.jax`: XLA compiled them): after a `forward` or
    `backward` call with these arrays and keywords (the output buffers given), a callable
    ``replay(*addresses) -> bool`` that runs it again on the device addresses of new
    arrays (inputs, then outputs, in the call's order), skipping validation; it returns
    False, having run nothing, where the addresses do not suit it. None where the backend
    cannot replay the call (the host backends; ALiBi, dropout, variable-length calls).
    A backward replay keeps scratch memory; ``allocate(bytes) -> address`` supplies it
    where given (memory the caller keeps alive as long as the replay)."""
    if any(keywords.pop(name, None) is not None for name in VARLEN_KEYWORDS):
        return None
    forward_call = function_name == "forward"
    outputs = {name: keywords.pop(name, None) for name in _OUTPUT_NAMES[function_name]}
    # In the order `forward` and `backward` pass them: the same call signature, which the
    # problem cache then already knows.
    options = {name: keywords.pop(name, default) for name, default in _OPTION_DEFAULTS}
    if keywords:
        raise TypeError(f"replay() got unexpected keyword arguments {sorted(keywords)}")
    inputs = dict(zip(("q", "k", "v") if forward_call else ("do", "q", "k", "v", "o", "lse"),
                      arrays))
    problem = validate_call(inputs.pop("q"), inputs.pop("k"), inputs.pop("v"), **inputs,
                            **options, layout=layout, outputs=outputs, varlen=None,
                            check_lengths=check_lengths)
    module = _resolve_backend(backend, problem.layout.memory)
    make = getattr(module, "replay", None)
    if make is None or problem.is_empty:
        return None
    return make(function_name, problem.tensors, problem.options, allocate, problem.outputs)


def forward(q, k, v, *, causal=False, window=None, scale=None, softcap=None, alibi_slopes=None,
            dropout_p=0.0, seed=None, block_q=None, block_k=None, backend="auto",
            return_lse=False, layout="bhsd", out=None, lse_out=None, seqlens_q=None,
            seqlens_k=None, cu_seqlens_q=None, cu_seqlens_k=None, block_table=None,
            check_lengths=True):
    """Exact softmax attention, computed tile by tile in O(N) extra memory.

    Parameters
    ----------
    q : array, shape (*batch, Hq, Nq, D) or (Nq, D)
    k : array, shape (*batch, Hkv, Nk, D) or (Nk, D); ``Hq % Hkv == 0`` (GQA/MQA)
    v : array, shape (*batch, Hkv, Nk, Dv) or (Nk, Dv)
        (With ``layout="bshd"``: ``(*batch, Nq, Hq, D)``, ``(*batch, Nk, Hkv, D)`` and
        ``(*batch, Nk, Hkv, Dv)``.)
        One floating dtype for all three (float16, bfloat16, float32, float64), all NumPy
        (host) or all CuPy (GPU). Any strides. Never modified. Any byte order, mixed too:
        arrays not in the machine's byte order (``'>f8'`` on x86) are copied once into it
        here, then computed in their dtype's precision like native ones.
    causal : bool
        Keep key ``j`` for row ``i`` only when ``j <= i + Nk - Nq``. Same as ``window=(left, 0)``.
    window : (left, right) or None
        Keep ``j`` in ``[i + Nk - Nq - left, i + Nk - Nq + right]``; None or negative = unlimited.
    scale : float, default ``1 / sqrt(D)``
    softcap : float or None
        When positive, scores become ``softcap * tanh(scores / softcap)``.
    alibi_slopes : array of shape (Hq,) or (*batch, Hq), optional
        Adds ``-slope * |i + Nk - Nq - j|`` to each score.

        `scale`, `softcap` and each slope must be 0 or survive the compute dtype (float32
        for 16/32-bit inputs, float64 for float64): a nonzero value that rounds to zero or
        to a subnormal there (``softcap=1e-46`` with float32), or that overflows once
        multiplied by log2(e) (or, for softcap, ``scale / softcap``), raises a ValueError
        naming it and its rounded value, since backends would treat it differently.
    dropout_p : float in [0, 1)
        Drops probabilities with the counter-based hash of `tileattn.dropout`, so every
        backend drops the same entries for the same `seed` (required when dropout_p > 0),
        and scales the kept ones by ``1 / (1 - dropout_p)``. The hash drops an entry when
        its 16 random bits fall below ``floor(dropout_p * 2**16)``, so a
        ``0 < dropout_p < 2**-16`` drops nothing: every backend treats it as 0 (no
        dropout, no rescale).
    block_q, block_k : int, optional
        Tile sizes; any positive int. Default: chosen by the backend for the cache size.
    backend : {"auto", "cpu", "gpu", "reference"}
        "auto" is the GPU backend for CuPy arrays and the CPU (Numba) backend for host
        arrays; when that backend cannot run it raises `tileattn.BackendUnavailableError`
        naming the pip extra that installs it. It never picks "reference", the O(N^2)-memory
        golden model, which runs only when asked for by name.
    return_lse : bool
        Also return ``lse``, the natural-log logsumexp of each row's scores (for `backward`).
    layout : {"bhsd", "bshd"}
        The order of the heads and sequence axes: "bhsd" (default) is
        ``(*batch, heads, seqlen, dim)``; "bshd" is ``(*batch, seqlen, heads, dim)``, the
        layout of flash-attn's ``flash_attn_func``. "bshd" arrays are read as strided views
        (``swapaxes``), never copied. On the GPU `o` comes back C-contiguous in "bshd" (the
        kernels write it in that order, as flash-attn's); the host backends return it as a
        view of a "bhsd" buffer (``np.ascontiguousarray`` packs it). `lse` is
        ``(*batch, Hq, Nq)`` in both layouts, as flash-attn's ``softmax_lse``. 2-D
        ``(N, D)`` arrays have no head axis and mean the same in both.
    out, lse_out : array, optional
        Buffers to write ``o`` and ``lse`` into (both, either or neither), returned in
        their place. Each must have exactly the result's shape and dtype, sit in the
        inputs' memory (the same GPU for CuPy arrays), be writeable, be C-contiguous in
        the call's layout (with "bshd", a ``swapaxes(-3, -2)`` view of a C-contiguous
        ``(*batch, H, N, D)`` buffer is taken too), start on a GPU at an address aligned
        to two elements (new CuPy arrays are) where its last axis is even, and share no
        memory with an input or the other buffer; else a ValueError names it. The GPU backend
        writes into them directly; the CPU and reference backends compute as usual and
        copy the result in (one copy of ``o``), so on the host they save no memory.
    seqlens_q, seqlens_k : integer array of shape `*batch`, optional
        Padded batch (SPEC "Variable-length batches and paged K/V"): batch element ``b``
        uses query rows ``i < seqlens_q[b]`` and keys ``j < seqlens_k[b]``; masks, the
        bottom-right alignment and ALiBi use these lengths in place of Nq and Nk (causal
        keeps ``j <= i + seqlens_k[b] - seqlens_q[b]``). ``0 <= seqlens_q[b] <= Nq``,
        ``0 <= seqlens_k[b] <= Nk``; any integer dtype, NumPy (or the inputs' library).
        Padding rows give ``o = 0`` and ``lse = -inf``; padding is never read.
    cu_seqlens_q, cu_seqlens_k : integer array of shape (S + 1,), optional
        Packed sequences, both given: q is ``(Hq, Nq_total, D)`` (bshd:
        ``(Nq_total, Hq, D)``, flash-attn's varlen layout), and sequence ``s`` is rows
        ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` against keys
        ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``, positions per sequence, no attention across
        sequences. Each starts at 0, is non-decreasing and ends at the packed length.
        `alibi_slopes` is then ``(Hq,)`` or ``(S, Hq)``.
    block_table : integer array of shape (*batch, max_pages), optional
        Paged K/V (forward only; needs `seqlens_k`): k and v are page pools
        ``(num_pages, Hkv, page_size, D)`` and ``(num_pages, Hkv, page_size, Dv)`` (bshd:
        ``(num_pages, page_size, Hkv, D)``, vLLM's and flash-attn's cache layout; any
        strides, so a transposed view is read without a copy of the pool's layout), and
        logical key ``j`` of batch element ``b`` is
        ``k[block_table[b, j // page_size], :, j % page_size]``. The first
        ``ceil(seqlens_k[b] / page_size)`` entries of row ``b`` must be page ids in
        ``[0, num_pages)``; the others are never read. `seqlens_q` may also be given.
    check_lengths : bool
        True (default): check the contents of the lengths and the block table, raising a
        ValueError naming the argument. For CuPy arrays that check is a device-to-host copy;
        ``False`` skips it (dtype and shape are still checked) for decode loops that
        know their tables are right. Unchecked lengths are clamped into their axes and page
        ids into the pool, so a bad value gives wrong numbers, never an out-of-bounds read
        or write. Dropout numbers sequence ``s`` as batch ``s`` with positions within the
        sequence (docs/varlen.md), in every family.

    Returns
    -------
    o : array, shape (*batch, Hq, Nq, Dv) (bshd: (*batch, Nq, Hq, Dv)), dtype of q in native
        byte order
    lse : array, shape (*batch, Hq, Nq), float32 (float64 for float64 inputs); if return_lse
        (`out` and `lse_out` themselves when given)
    """
    check_bool("return_lse", return_lse)
    # The options as values in `problem_cache.OPTION_NAMES` order: `validate_call`'s
    # sixteen keywords would cost ~3 us more.
    options = (causal, window, scale, softcap, alibi_slopes, dropout_p, seed, block_q,
               block_k, True)
    lengths = _length_keywords(seqlens_q, seqlens_k, cu_seqlens_q, cu_seqlens_k, block_table)
    dense = None
    if out is None and lse_out is None and lengths is None:
        results, dense = _straight_to_backend("forward", (q, k, v), options, layout,
                                              check_lengths, backend)
        if results is not None:
            return results if return_lse else results[0]
    problem = remembered_problem(
        (q, k, v), options, layout,
        None if out is None and lse_out is None else {"out": out, "lse_out": lse_out},
        lengths, check_lengths, dense)
    o, lse = run_forward(problem, backend)
    o = problem.layout.restore(o, problem.n_q_heads) if out is None else out
    if not return_lse:
        return o
    return o, (problem.layout.restore(lse, problem.n_q_heads, is_lse=True)
               if lse_out is None else lse_out)


forward.__doc__ += _CAUSAL_PICTURE


def backward(do, q, k, v, o, lse, *, causal=False, window=None, scale=None, softcap=None,
             alibi_slopes=None, dropout_p=0.0, seed=None, block_q=None, block_k=None,
             backend="auto", deterministic=True, layout="bhsd", dq_out=None, dk_out=None,
             dv_out=None, seqlens_q=None, seqlens_k=None, cu_seqlens_q=None,
             cu_seqlens_k=None, block_table=None, check_lengths=True):
    """Gradients of `forward`: the exact vector-Jacobian product for output gradient `do`.

    Pass the same options as to `forward`, and its `o` and `lse` (``return_lse=True``).
    Tiles of the probabilities are recomputed from `lse`; nothing of size Nq x Nk is stored.
    The row term ``D_i = rowsum(do_i * o_i)`` is formed from the `o` passed here (SPEC; as
    FlashAttention-2, -3 and cuDNN do), so the result is the exact gradient for that `o`:
    with the exact forward output it is the exact gradient of `forward`, and a 16-bit `o`'s
    rounding reaches ``dq`` through ``D`` (on sharply peaked attention by up to about the
    dtype's tolerance).

    Parameters
    ----------
    do, o : array, shape (*batch, Hq, Nq, Dv) (bshd: (*batch, Nq, Hq, Dv)), dtype of q
    q, k, v : as in `forward`
    lse : array, shape (*batch, Hq, Nq) in both layouts
    deterministic : bool
        True (default): the result does not depend on thread scheduling. False lets a backend
        use a faster variant that documents what it gives up.
    layout : {"bhsd", "bshd"}
        As in `forward`: with "bshd", `do`, `o`, `q`, `k`, `v` are read as views; the
        gradients come back C-contiguous in "bshd" on the GPU (the kernels write them in
        that order) and as "bshd" views of "bhsd" buffers from the host backends.
    dq_out, dk_out, dv_out : array, optional
        Buffers to write the gradients into, returned in their place; the same rules as
        `forward`'s `out` (shape and dtype of q, k, v; C-contiguous in the call's layout, or
        with "bshd" the swapaxes view of a C-contiguous ``(*batch, H, N, D)`` buffer; no
        memory shared with an input or another buffer). The GPU backend writes into
        them directly, in either order; the CPU and reference backends copy the result in.
    seqlens_q, seqlens_k, cu_seqlens_q, cu_seqlens_k, check_lengths
        As in `forward`, the same values. Padding rows get ``dq = 0``, padding keys
        ``dk = dv = 0``.
    block_table
        Not accepted: paged K/V is forward only (SPEC), so any value but None raises a
        ValueError naming it.

    Returns
    -------
    dq : like q;  dk : like k;  dv : like v  (same layout; dtypes in native byte order)
        For GQA/MQA, ``dk`` and ``dv`` sum over the query heads that share a kv head.
        (`dq_out`, `dk_out`, `dv_out` themselves when given)
    """
    options = (causal, window, scale, softcap, alibi_slopes, dropout_p, seed, block_q, block_k,
               deterministic)
    lengths = _length_keywords(seqlens_q, seqlens_k, cu_seqlens_q, cu_seqlens_k, block_table)
    dense = None
    if dq_out is None and dk_out is None and dv_out is None and lengths is None:
        results, dense = _straight_to_backend("backward", (q, k, v, do, o, lse), options,
                                              layout, check_lengths, backend)
        if results is not None:
            return results
    problem = remembered_problem(
        (q, k, v, do, o, lse), options, layout,
        (None if dq_out is None and dk_out is None and dv_out is None
         else {"dq_out": dq_out, "dk_out": dk_out, "dv_out": dv_out}),
        lengths, check_lengths, dense)
    dq, dk, dv = run_backward(problem, backend)
    return tuple(problem.layout.restore(result, heads) if given is None else given
                 for result, heads, given in ((dq, problem.n_q_heads, dq_out),
                                              (dk, problem.n_kv_heads, dk_out),
                                              (dv, problem.n_kv_heads, dv_out)))
