"""Property-testing kit for attention code: hypothesis strategies and a closeness check.

Public, so that you can test your own attention implementation the way tileattn tests its
kernels: draw problems with `attention_problems`, compute the float64 golden result with
``tileattn.forward(..., backend="reference")`` and compare with `assert_attention_close`::

    from hypothesis import given
    import numpy as np, tileattn
    from tileattn.testing import attention_problems, assert_attention_close

    @given(attention_problems())
    def test_my_attention(problem):
        expected = tileattn.forward(*problem.as_float64(), **problem.options,
                                    backend="reference")
        actual = my_attention(problem.q, problem.k, problem.v, **problem.options)
        assert_attention_close(actual, expected, problem.dtype, name="o")

Variable-length batches and paged K/V (SPEC "Variable-length batches and paged K/V") have
their own strategies: `sequence_lengths` (a padded batch's ``seqlens_q`` / ``seqlens_k``),
`cu_seqlens` (packed sequences' cumulative lengths), `page_tables` (a block table and the
size of its page pool), and `varlen_problems`, which draws a whole padded, packed or paged
problem together with the same problem as a padded batch, NaN in every place that must not
be read::

    from tileattn import reference_varlen
    from tileattn.testing import varlen_problems

    @given(varlen_problems(family="packed"))
    def test_my_packed_attention(problem):
        expected = reference_varlen.forward_packed(problem.q, problem.k, problem.v,
                                                   **problem.lengths, **problem.options)
        actual = my_packed_attention(problem.q, problem.k, problem.v, **problem.lengths,
                                     **problem.options)
        assert_attention_close(actual[0], expected[0], problem.dtype, name="o")

Per-dtype tolerances live here and only here (`TOLERANCES`). The strategies need
hypothesis (``pip install 'tileattn[test]'``); the tolerances and `assert_attention_close`
do not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

try:
    from hypothesis import strategies as st
except ImportError:  # the strategies say so when called; the tolerances still work
    st = None

__all__ = [
    "TOLERANCES", "Tolerance", "AttentionProblem", "attention_problems",
    "draw_attention_problem", "block_sizes", "float_dtypes", "assert_attention_close",
    "attention_error", "tolerance_for", "bfloat16", "sequence_lengths", "cu_seqlens",
    "page_tables", "VarlenProblem", "varlen_problems",
]


def bfloat16():
    """The ml_dtypes bfloat16 dtype, or None when ml_dtypes is not installed."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


@dataclass(frozen=True)
class Tolerance:
    """``|actual - expected| <= atol * scale + rtol * |expected|`` elementwise, where
    ``scale`` is the root-mean-square of the finite expected values, at least 1: errors of
    a tiled computation are relative to the magnitude of the whole tensor, not of each
    element. The floor of 1 (the scale of unit-normal test inputs) is there because a
    gradient can cancel to pure rounding noise (``dq`` is exactly 0 with one key, computed
    as a difference of O(1) terms), and noise must not set its own tolerance."""

    rtol: float
    atol: float


# Each is about 10x the unit roundoff of the dtype times the growth of a length-~500
# reduction (float32 and float64) or the rounding of the low-precision operands that the
# tensor-core path feeds to its matrix products (float16, bfloat16), judged against the
# float64 golden model computed from the same (already rounded) inputs.
TOLERANCES = {
    "float64": Tolerance(rtol=1e-10, atol=1e-10),
    "float32": Tolerance(rtol=1e-4, atol=1e-4),
    "float16": Tolerance(rtol=5e-3, atol=5e-3),
    "bfloat16": Tolerance(rtol=4e-2, atol=4e-2),
}


def _dtype_name(dtype) -> str:
    """The name of `dtype`, also given as a name: NumPy's np.dtype does not know the string
    "bfloat16" (ml_dtypes registers the type, not the name)."""
    return dtype if isinstance(dtype, str) and dtype in TOLERANCES else np.dtype(dtype).name


def tolerance_for(dtype) -> Tolerance:
    """The tolerance of a computation in `dtype` (one of `TOLERANCES`' keys, or its name)."""
    name = _dtype_name(dtype)
    if name not in TOLERANCES:
        raise ValueError(f"no tolerance for dtype {name}: attention runs in "
                         f"{', '.join(TOLERANCES)}")
    return TOLERANCES[name]


def attention_error(actual, expected, dtype, *, lse_magnitude: float = 0.0) -> float:
    """The largest error as a multiple of what `dtype`'s tolerance allows (<= 1 passes);
    inf when non-finite values differ in place or sign."""
    actual = np.asarray(actual).astype(np.float64)
    expected = np.asarray(expected).astype(np.float64)
    if actual.shape != expected.shape:
        raise ValueError(f"shape {actual.shape} != expected {expected.shape}")
    same_non_finite = (np.isnan(actual) == np.isnan(expected)) & (
        ~(np.isinf(actual) | np.isinf(expected)) | (actual == expected))
    if not same_non_finite.all():
        return float("inf")
    finite = np.isfinite(expected)
    if not finite.any():
        return 0.0
    allowed = _allowed(expected[finite], dtype, lse_magnitude)
    return float(np.max(np.abs(actual[finite] - expected[finite]) / allowed))


def _allowed(finite_expected, dtype, lse_magnitude: float):
    """Elementwise allowed error for finite expected values (see `Tolerance`)."""
    tolerance = tolerance_for(dtype)
    lse_rounding = _lse_rounding(dtype, lse_magnitude)
    return ((tolerance.atol + lse_rounding) * _magnitude(finite_expected)
            + (tolerance.rtol + lse_rounding) * np.abs(finite_expected))


def _lse_rounding(dtype, lse_magnitude: float) -> float:
    """Relative error a backward pass inherits from the stored lse.

    Backward recomputes ``P = exp(s - lse)`` from the lse that forward stored (float32, or
    float64 for float64 inputs). Rounding lse to that dtype moves it by up to half a unit in
    the last place of ``|lse|``, which scales every ``P`` by ``exp(that)``: with scores near
    1e4 in float32 that is 5e-4, whatever the kernel does. Gradients are judged with this
    term added when the caller passes the size of the scores as `lse_magnitude`.
    """
    if not lse_magnitude:
        return 0.0
    lse_type = np.float64 if _dtype_name(dtype) == "float64" else np.float32
    return float(np.spacing(lse_type(abs(lse_magnitude)))) / 2


def _magnitude(finite_values) -> float:
    return max(1.0, float(np.sqrt(np.mean(finite_values ** 2))))


def assert_attention_close(actual, expected, dtype, *, name: str = "result",
                           lse_magnitude: float = 0.0):
    """Assert `actual` matches the golden `expected` within `dtype`'s tolerance.

    Shapes must agree; NaN and infinities must sit at the same places with the same sign.
    `dtype` is the dtype the computation ran in (the inputs' dtype), which sets the
    tolerance; the arrays themselves may have any float dtype (lse is float32, say).
    For gradients of problems with very large scores, pass the largest ``|lse|`` as
    `lse_magnitude`: the rounding of the stored lse then joins the tolerance
    (see `_lse_rounding`).
    """
    actual = np.asarray(actual).astype(np.float64)
    expected = np.asarray(expected).astype(np.float64)
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {actual.shape} != expected {expected.shape}")
    nan_mismatch = np.isnan(actual) != np.isnan(expected)
    inf_mismatch = np.isinf(expected) & (actual != expected)
    inf_mismatch |= np.isinf(actual) & (actual != expected)
    if nan_mismatch.any() or inf_mismatch.any():
        where = np.argwhere(nan_mismatch | inf_mismatch)[0]
        raise AssertionError(
            f"{name}: non-finite values differ, first at index {tuple(where)}: "
            f"actual {actual[tuple(where)]}, expected {expected[tuple(where)]} "
            f"({int((nan_mismatch | inf_mismatch).sum())} elements)")
    finite = np.isfinite(expected)
    if not finite.any():
        return
    allowed = np.full(expected.shape, np.inf)
    allowed[finite] = _allowed(expected[finite], dtype, lse_magnitude)
    with np.errstate(invalid="ignore"):  # inf - inf where both are the same infinity
        error = np.abs(actual - expected)
    bad = finite & ~(error <= allowed)
    if bad.any():
        tolerance = tolerance_for(dtype)
        where = tuple(np.argwhere(bad)[0])
        worst = np.max(np.where(finite, error / allowed, 0))
        raise AssertionError(
            f"{name} ({_dtype_name(dtype)}): {int(bad.sum())} of {bad.size} elements out of "
            f"tolerance (rtol={tolerance.rtol}, atol={tolerance.atol} x rms "
            f"{_magnitude(expected[finite]):.3g}); first at {where}: actual {actual[where]!r}, "
            f"expected {expected[where]!r}; worst error is {worst:.3g}x the allowed")


# --------------------------------------------------------------------------- strategies


def _strategies():
    if st is None:
        raise ImportError("tileattn.testing strategies need hypothesis: "
                          "pip install 'tileattn[test]'")
    return st


def float_dtypes(include_bfloat16: bool = True):
    """float16, bfloat16 (when ml_dtypes is installed), float32, float64."""
    st = _strategies()
    dtypes = [np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)]
    if include_bfloat16 and bfloat16() is not None:
        dtypes.insert(1, bfloat16())
    return st.sampled_from(dtypes)


def _dtype_strategy(dtypes):
    """The strategies' `dtypes`: None (`float_dtypes`), a strategy of dtypes, or dtypes and
    dtype names to sample from ("bfloat16" by name too)."""
    st = _strategies()
    if dtypes is None:
        return float_dtypes()
    if isinstance(dtypes, st.SearchStrategy):
        return dtypes
    if isinstance(dtypes, (str, np.dtype, type)):
        dtypes = [dtypes]
    chosen = []
    for dtype in dtypes:
        if isinstance(dtype, str) and dtype == "bfloat16":
            if bfloat16() is None:
                raise ValueError("dtypes names bfloat16, which needs ml_dtypes: pip install "
                                 "ml_dtypes")
            chosen.append(bfloat16())
        else:
            chosen.append(np.dtype(dtype))
    if not chosen:
        raise ValueError("dtypes is empty: name at least one dtype")
    return st.sampled_from(chosen)


_INTERESTING_BLOCKS = (1, 2, 3, 5, 7, 8, 13, 16, 31, 32, 64, 97, 128, 4096)


def block_sizes():
    """None (backend's choice), 1, primes, powers of two, and sizes beyond any sequence."""
    st = _strategies()
    return st.one_of(st.none(), st.sampled_from(_INTERESTING_BLOCKS))


_HEAD_DIMS = (1, 2, 3, 5, 8, 16, 24, 32, 40, 64, 80, 96, 128, 160, 192, 256)


@dataclass
class AttentionProblem:
    """One drawn attention problem: inputs, an output gradient, and keyword options.

    ``q, k, v, do`` are NumPy arrays of `dtype` (possibly non-contiguous); `options` holds the
    keyword arguments for `tileattn.forward` / `tileattn.backward` (without `backend`).
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    do: np.ndarray
    options: dict = field(default_factory=dict)

    @property
    def dtype(self) -> np.dtype:
        return self.q.dtype

    def as_float64(self):
        return tuple(a.astype(np.float64) for a in (self.q, self.k, self.v))

    def __repr__(self):
        shown = {k: (v.tolist() if isinstance(v, np.ndarray) else v)
                 for k, v in self.options.items()}
        return (f"AttentionProblem(q{self.q.shape}, k{self.k.shape}, v{self.v.shape}, "
                f"dtype={self.dtype.name}, strides q{self.q.strides}, options={shown})")


def _layout(rng: np.random.Generator, array: np.ndarray, kind: str) -> np.ndarray:
    """The same values in a different memory layout: contiguous, transposed or reversed."""
    if kind == "transposed" and array.ndim >= 3:
        # Stored as (..., N, H, D) like many frameworks' (batch, seq, heads, dim).
        stored = np.ascontiguousarray(np.swapaxes(array, -2, -3))
        return np.swapaxes(stored, -2, -3)
    if kind == "reversed":
        stored = np.ascontiguousarray(array[..., ::-1, :])
        return stored[..., ::-1, :]
    return array


def attention_problems(**settings):
    """Strategy for `AttentionProblem`; keyword settings are those of `draw_attention_problem`.
    """
    return _strategies().composite(draw_attention_problem)(**settings)


def draw_attention_problem(draw, *, dtypes=None, max_batch_dims: int = 2, max_heads: int = 4,
                       max_seq: int = 48, head_dims=_HEAD_DIMS, max_elements: int = 60_000,
                       options: bool = True, allow_empty: bool = True):
    """Draw an `AttentionProblem` (use through `attention_problems`).

    Covers zero-length and length-1 axes, ``Nq != Nk``, head dims 1-256 with ``Dv != D``,
    GQA/MQA ratios, 0-2 batch dimensions or a bare 2-D ``(N, D)`` problem, non-contiguous
    layouts, every option of `tileattn.forward` (causal, window, scale, softcap, ALiBi,
    dropout with a seed) and block sizes including 1, primes and sizes beyond the sequence.
    `max_elements` bounds ``batch * Hq * Nq * Nk * max(D, Dv)`` to keep examples quick.
    Inputs are unit normal, except ``do``, which is ``1 - dropout_p`` times that with
    dropout (see below). `dtypes`: a strategy of dtypes, or dtypes (or their names,
    "bfloat16" too) to sample from; default `float_dtypes`.
    """
    st = _strategies()
    dtype = draw(_dtype_strategy(dtypes))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    min_seq = 0 if allow_empty else 1
    n_q = draw(st.integers(min_seq, max_seq))
    n_k = draw(st.one_of(st.just(n_q), st.integers(min_seq, max_seq)))
    d = draw(st.sampled_from(head_dims))
    d_v = draw(st.one_of(st.just(d), st.sampled_from(head_dims)))
    single_head = draw(st.booleans()) and max_batch_dims >= 0 and draw(st.booleans())
    if single_head:
        batch_shape, n_kv_heads, group = (), 1, 1
    else:
        n_batch_dims = draw(st.integers(0, max_batch_dims))
        batch_shape = tuple(draw(st.lists(st.integers(min_seq, 2), min_size=n_batch_dims,
                                          max_size=n_batch_dims)))
        n_kv_heads = draw(st.integers(min_seq if allow_empty else 1, max(1, max_heads // 2)))
        group = draw(st.sampled_from([g for g in (1, 2, 3, 4) if g * n_kv_heads <= max_heads]
                                     or [1]))
    n_q_heads = n_kv_heads * group
    budget = max(1, int(np.prod(batch_shape))) * max(n_q_heads, 1) * max(d, d_v)
    while n_q * n_k * budget > max_elements and max(n_q, n_k) > 1:
        n_q, n_k = (n_q + 1) // 2, (n_k + 1) // 2

    def normal(*shape):
        return rng.standard_normal(shape).astype(dtype)

    heads_q = () if single_head else (n_q_heads,)
    heads_kv = () if single_head else (n_kv_heads,)
    q = normal(*batch_shape, *heads_q, n_q, d)
    k = normal(*batch_shape, *heads_kv, n_k, d)
    v = normal(*batch_shape, *heads_kv, n_k, d_v)
    do = normal(*batch_shape, *heads_q, n_q, d_v)
    layout = draw(st.sampled_from(["contiguous", "transposed", "reversed"]))
    q, k, v, do = (_layout(rng, a, layout) for a in (q, k, v, do))

    kwargs = {}
    if options:
        kwargs["causal"] = draw(st.booleans())
        if draw(st.booleans()):
            side = st.one_of(st.none(), st.integers(-1, max_seq + 2))
            kwargs["window"] = (draw(side), draw(side))
        if draw(st.booleans()):
            kwargs["scale"] = draw(st.sampled_from([0.0, 0.05, 0.3, 1.0, -0.7, 2.5]))
        if draw(st.booleans()):
            kwargs["softcap"] = draw(st.sampled_from([0.0, 0.5, 3.0, 30.0]))
        if draw(st.booleans()):
            per_batch = draw(st.booleans()) and not single_head
            shape = (*batch_shape, n_q_heads) if per_batch else (n_q_heads,)
            kwargs["alibi_slopes"] = rng.uniform(0.0, 1.0, size=shape)
        if draw(st.booleans()):
            kwargs["dropout_p"] = draw(st.sampled_from([0.1, 0.5, 0.9]))
            kwargs["seed"] = draw(st.integers(0, 2**64 - 1))
            # Dropout scales dP = dO V^T by 1 / (1 - p), and the backward's
            # dS = P (dP - rowsum(dO * O)) is a difference of such terms: at p = 0.9 and
            # Dv = 256 they reach ~400 and cancel to ~0.1, so the float32 rounding of any
            # correct implementation (a plain NumPy float32 one included) is 3.6x the
            # tolerance of the result. dO drawn at (1 - p) times unit scale keeps dP at the
            # unit scale the tolerances are set for.
            np.multiply(do, do.dtype.type(1.0 - kwargs["dropout_p"]), out=do)
        kwargs["block_q"] = draw(block_sizes())
        kwargs["block_k"] = draw(block_sizes())
    return AttentionProblem(q, k, v, do, kwargs)


# --------------------------------------------------------------------------- variable lengths


def sequence_lengths(max_length: int, *, batch_shape: tuple = (), min_length: int = 0):
    """Strategy for a padded batch's lengths (``seqlens_q`` or ``seqlens_k``).

    Draws an int32 or int64 NumPy array of shape `batch_shape` with values in
    ``[min_length, max_length]``, often at 0, 1 and `max_length`, where the masks and the
    bottom-right alignment change.
    """
    st = _strategies()
    edges = sorted({n for n in (min_length, 1, max_length) if min_length <= n <= max_length})
    length = st.one_of(st.sampled_from(edges), st.integers(min_length, max_length))
    count = math.prod(batch_shape)
    return st.builds(lambda values, dtype: np.array(values, dtype=dtype).reshape(batch_shape),
                     st.lists(length, min_size=count, max_size=count),
                     st.sampled_from([np.int32, np.int64]))


def _cumulative(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(lengths.dtype)


def cu_seqlens(n_sequences: int, max_length: int, *, min_length: int = 0):
    """Strategy for the cumulative lengths of `n_sequences` packed sequences.

    Draws an int32 or int64 array of shape ``(n_sequences + 1,)`` starting at 0, each
    sequence ``[min_length, max_length]`` long (empty sequences included by default). Draw
    ``cu_seqlens_q`` and ``cu_seqlens_k`` with the same `n_sequences`.
    """
    return sequence_lengths(max_length, batch_shape=(n_sequences,),
                            min_length=min_length).map(_cumulative)


def page_tables(seqlens_k, page_size: int, *, max_spare_pages: int = 2,
                max_spare_columns: int = 2):
    """Strategy for a block table that holds `seqlens_k` keys in pages of `page_size`.

    Draws ``(block_table, num_pages)``: `block_table` is an int32 or int64 array of shape
    ``(*seqlens_k.shape, max_pages)`` whose rows name distinct pages of a pool of
    `num_pages` pages, in random order. Up to `max_spare_pages` pages of the pool are named
    by no row, and up to `max_spare_columns` columns after the ones a row reads hold -1,
    `num_pages` or 0: a correct implementation reads none of them.
    """
    return _strategies().composite(_draw_page_table)(np.asarray(seqlens_k), page_size,
                                                     max_spare_pages, max_spare_columns)


def _draw_page_table(draw, seqlens_k: np.ndarray, page_size: int, max_spare_pages: int,
                     max_spare_columns: int):
    st = _strategies()
    pages_used = -(-seqlens_k.reshape(-1).astype(np.int64) // page_size)
    num_pages = int(pages_used.sum()) + draw(st.integers(0, max_spare_pages))
    order = draw(st.permutations(range(num_pages)))
    max_pages = int(pages_used.max(initial=0)) + draw(st.integers(0, max_spare_columns))
    unread = draw(st.sampled_from([-1, num_pages, 0]))
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    table = np.full((len(pages_used), max_pages), unread, dtype=dtype)
    starts = _cumulative(pages_used)
    for b, count in enumerate(pages_used):
        table[b, :count] = order[starts[b]:starts[b] + count]
    return table.reshape(seqlens_k.shape + (max_pages,)), num_pages


VARLEN_FAMILIES = ("padded", "packed", "paged")


@dataclass
class VarlenProblem:
    """One drawn variable-length problem (see `varlen_problems`).

    Attributes
    ----------
    family : {"padded", "packed", "paged"}
    q, k, v, do : numpy.ndarray
        The family's inputs: padded ``(*batch, H, N, D)`` arrays; packed ``(H, N_total, D)``
        arrays; or for paged, padded ``q``, ``do`` and page pools
        ``k (num_pages, Hkv, page_size, D)``, ``v (num_pages, Hkv, page_size, Dv)``. NaN
        wherever nothing may be read: padding rows and keys, unnamed pages, page slots past
        ``seqlens_k``.
    lengths : dict
        The length keywords of the family: ``seqlens_q`` and ``seqlens_k`` (either may be
        None), ``cu_seqlens_q`` and ``cu_seqlens_k``, or ``block_table``, ``seqlens_k``
        and ``seqlens_q``; named as `tileattn.reference_varlen` takes them.
    options : dict
        Keyword options of `tileattn.forward` (no block sizes, no backend).
    padded : VarlenProblem or None
        For packed and paged problems, the same problem as a padded batch (packed sequence
        ``s`` is batch element ``s``; paged keys gathered into ``max_pages * page_size``
        rows); None for a padded problem.
    """

    family: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    do: np.ndarray
    lengths: dict
    options: dict = field(default_factory=dict)
    padded: "VarlenProblem | None" = None

    @property
    def dtype(self) -> np.dtype:
        return self.q.dtype

    def __repr__(self):
        def shown(values):
            return {k: (v.tolist() if isinstance(v, np.ndarray) else v)
                    for k, v in values.items()}
        return (f"VarlenProblem({self.family}, q{self.q.shape}, k{self.k.shape} strides "
                f"{self.k.strides}, v{self.v.shape}, dtype={self.dtype.name}, "
                f"lengths={shown(self.lengths)}, options={shown(self.options)})")


def varlen_problems(**settings):
    """Strategy for `VarlenProblem`; keyword settings are those of `draw_varlen_problem`."""
    return _strategies().composite(draw_varlen_problem)(**settings)


def draw_varlen_problem(draw, *, family=None, dtypes=None, max_batch: int = 3,
                        max_heads: int = 4, max_seq: int = 12, head_dims=(1, 2, 3, 8, 16),
                        page_sizes=(1, 2, 3, 16), options: bool = True):
    """Draw a `VarlenProblem` (use through `varlen_problems`).

    `family` is one of `VARLEN_FAMILIES` or None (any). Covers empty batches (no packed
    sequences), lengths 0 and 1, ``Lq != Lk``, padding after the longest sequence, GQA/MQA,
    ``Dv != D``, absent ``seqlens_q``/``seqlens_k`` (padded), empty packed sequences, pages
    in any order in pools stored ``(num_pages, Hkv, page_size, D)`` or
    ``(num_pages, page_size, Hkv, D)`` (passed transposed), and every option of
    `tileattn.forward` with ALiBi slopes per head or per sequence. `dtypes` as for
    `draw_attention_problem`.
    """
    st = _strategies()
    family = family if family is not None else draw(st.sampled_from(VARLEN_FAMILIES))
    dtype = draw(_dtype_strategy(dtypes))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if family == "packed":
        batch_shape = (draw(st.integers(0, max_batch)),)
    else:
        batch_shape = tuple(draw(st.lists(st.integers(0, max_batch), max_size=2)))
    n_kv_heads = draw(st.integers(1, max(1, max_heads // 2)))
    n_q_heads = n_kv_heads * draw(st.sampled_from(
        [g for g in (1, 2, 3, 4) if g * n_kv_heads <= max_heads] or [1]))
    d = draw(st.sampled_from(head_dims))
    d_v = draw(st.one_of(st.just(d), st.sampled_from(head_dims)))
    lengths_q = draw(sequence_lengths(max_seq, batch_shape=batch_shape))
    lengths_k = draw(sequence_lengths(max_seq, batch_shape=batch_shape))
    n_q = int(lengths_q.max(initial=0)) + draw(st.integers(0, 2))
    n_k = int(lengths_k.max(initial=0)) + draw(st.integers(0, 2))
    if family == "padded" and draw(st.booleans()):  # seqlens_q absent: every row is used
        n_q, lengths_q = max(n_q, 1), None
    if family == "padded" and draw(st.booleans()):
        n_k, lengths_k = max(n_k, 1), None
    padded = _padded_problem(rng, dtype, batch_shape, (n_q_heads, n_kv_heads), (n_q, n_k),
                             (d, d_v), lengths_q, lengths_k)
    if options:
        padded.options = _draw_varlen_options(draw, rng, batch_shape, n_q_heads, max_seq)
    if family == "padded":
        return padded
    if family == "packed":
        return _packed_from(padded)
    page_size = draw(st.sampled_from(page_sizes))
    block_table, num_pages = draw(page_tables(lengths_k, page_size))
    page_major = draw(st.booleans())
    return _paged_from(padded, block_table, num_pages, page_size, page_major)


def _padded_problem(rng, dtype, batch_shape, heads, sizes, dims, lengths_q, lengths_k):
    """Unit-normal padded arrays with NaN in padding rows (q, do) and keys (k, v)."""
    (n_q_heads, n_kv_heads), (n_q, n_k), (d, d_v) = heads, sizes, dims

    def normal(n_heads, n, dim, lengths):
        array = rng.standard_normal((*batch_shape, n_heads, n, dim))
        if lengths is not None:
            padding = np.arange(n) >= lengths[..., None]  # (*batch, n)
            array[np.broadcast_to(padding[..., None, :, None], array.shape)] = np.nan
        return array.astype(dtype)

    return VarlenProblem(
        "padded", q=normal(n_q_heads, n_q, d, lengths_q), k=normal(n_kv_heads, n_k, d, lengths_k),
        v=normal(n_kv_heads, n_k, d_v, lengths_k), do=normal(n_q_heads, n_q, d_v, lengths_q),
        lengths={"seqlens_q": lengths_q, "seqlens_k": lengths_k})


def _draw_varlen_options(draw, rng, batch_shape, n_q_heads, max_seq) -> dict:
    st = _strategies()
    kwargs = {"causal": draw(st.booleans())}
    if draw(st.booleans()):
        side = st.one_of(st.none(), st.integers(-1, max_seq + 2))
        kwargs["window"] = (draw(side), draw(side))
    if draw(st.booleans()):
        kwargs["scale"] = draw(st.sampled_from([0.05, 0.3, 1.0, -0.7]))
    if draw(st.booleans()):
        kwargs["softcap"] = draw(st.sampled_from([0.5, 3.0]))
    if draw(st.booleans()):
        shape = (*batch_shape, n_q_heads) if draw(st.booleans()) else (n_q_heads,)
        kwargs["alibi_slopes"] = rng.uniform(0.0, 1.0, size=shape)
    if draw(st.booleans()):
        kwargs["dropout_p"] = draw(st.sampled_from([0.1, 0.5]))
        kwargs["seed"] = draw(st.integers(0, 2**64 - 1))
    return kwargs


def _packed_from(padded: VarlenProblem) -> VarlenProblem:
    """Packed sequences: batch element ``s`` of `padded` is sequence ``s``."""
    lengths_q, lengths_k = padded.lengths["seqlens_q"], padded.lengths["seqlens_k"]

    def pack(array, lengths):  # (S, H, N, D) -> (H, sum(lengths), D)
        parts = [array[s, :, :length] for s, length in enumerate(lengths)]
        return np.concatenate(parts, axis=1) if parts else array[0:0].reshape(
            array.shape[1], 0, array.shape[3])

    return VarlenProblem(
        "packed", q=pack(padded.q, lengths_q), k=pack(padded.k, lengths_k),
        v=pack(padded.v, lengths_k), do=pack(padded.do, lengths_q),
        lengths={"cu_seqlens_q": _cumulative(lengths_q),
                 "cu_seqlens_k": _cumulative(lengths_k)},
        options=padded.options, padded=padded)


def _paged_from(padded: VarlenProblem, block_table, num_pages: int, page_size: int,
                page_major: bool) -> VarlenProblem:
    """Paged K/V holding `padded`'s keys at the pages `block_table` names; NaN elsewhere."""
    lengths_k = padded.lengths["seqlens_k"]
    flat_table = block_table.reshape(lengths_k.size, block_table.shape[-1])

    def pool(array):  # (*batch, Hkv, N, D) -> (num_pages, Hkv, page_size, D)
        n_kv_heads, dim = array.shape[-3], array.shape[-1]
        # page_major: stored (num_pages, page_size, Hkv, D), as vLLM and flash-attn keep it.
        stored = np.full((num_pages, page_size, n_kv_heads, dim) if page_major
                         else (num_pages, n_kv_heads, page_size, dim), np.nan, array.dtype)
        pages = stored.transpose(0, 2, 1, 3) if page_major else stored
        keys = array.reshape(lengths_k.size, n_kv_heads, array.shape[-2], dim)
        for b, length in enumerate(lengths_k.reshape(-1)):
            j = np.arange(length)
            pages[flat_table[b, j // page_size], :, j % page_size] = np.swapaxes(
                keys[b, :, :length], 0, 1)
        return pages

    n_keys = block_table.shape[-1] * page_size
    gathered_shape = padded.k.shape[:-2] + (n_keys,)
    as_padded = VarlenProblem(
        "padded", q=padded.q, k=_resized(padded.k, gathered_shape), v=_resized(
            padded.v, gathered_shape), do=padded.do, lengths=padded.lengths,
        options=padded.options)
    return VarlenProblem(
        "paged", q=padded.q, k=pool(padded.k), v=pool(padded.v), do=padded.do,
        lengths={"block_table": block_table, "seqlens_k": lengths_k,
                 "seqlens_q": padded.lengths["seqlens_q"]},
        options=padded.options, padded=as_padded)


def _resized(array: np.ndarray, shape: tuple) -> np.ndarray:
    """`array` with its key axis cut or NaN-padded to ``shape[-1]`` keys (keeping its last
    axis): the padded form of paged keys has ``max_pages * page_size`` of them."""
    n_keys = shape[-1]
    resized = np.full(shape + array.shape[-1:], np.nan, array.dtype)
    kept = min(n_keys, array.shape[-2])
    resized[..., :kept, :] = array[..., :kept, :]
    return resized
