"""Checks for variable-length batches and paged K/V (SPEC "Variable-length batches and paged
K/V"), shared by the golden model and the API layer (`tileattn.validation`).

Each check takes the caller's array (NumPy, or anything `tileattn.arrays.to_host` reads,
such as CuPy: the contents check is a small device-to-host copy), raises a `TypeError` for a
non-integer dtype and a `ValueError` for a bad shape or value, naming the argument, what was
expected and what was given, and returns the lengths as a host ``int64`` array the caller can
index without overflow. Unchecked lengths and tables of a GPU call that lie on its GPU
(`keep_device`, for ``check_lengths=False``) stay there as int32 or int64, with no copy and
no wait for the device: a decode loop's step then costs no synchronisation. Nothing here
writes to the caller's arrays.
"""

from __future__ import annotations

import math

import numpy as np

from . import arrays


def _integer_array(name: str, values, keep_device: int | None = None):
    values = arrays.to_native(values)
    if (keep_device is not None and arrays.memory_of(values) == "cuda"
            and values.device.id == keep_device):
        return _device_integers(name, values)
    values = np.asarray(arrays.to_host(values))
    if values.dtype.kind not in "iu":
        raise TypeError(f"{name} must have an integer dtype, got dtype {values.dtype}")
    if values.dtype == np.uint64 and values.size and values.max() > np.iinfo(np.int64).max:
        # int64 would wrap it to a negative number and the error would show that instead
        where = _first(values > np.iinfo(np.int64).max)
        raise ValueError(f"{name} holds {int(values[where])} at {where}, beyond any sequence "
                         f"length (int64)")
    return values.astype(np.int64)


def _device_integers(name: str, values):
    """A device array of an unchecked call, left where it is: int32 and int64 as they are
    (the kernels read either), other integer dtypes as int64."""
    if values.dtype.kind not in "iu":
        raise TypeError(f"{name} must have an integer dtype, got dtype {values.dtype}")
    if values.dtype not in (np.int32, np.int64):
        values = values.astype(np.int64)
    return values


def _first(condition: np.ndarray) -> tuple:
    return tuple(int(i) for i in np.argwhere(condition)[0])


def check_seqlens(name: str, seqlens, batch_shape: tuple, limit: int | None,
                  limit_name: str = "", check_values: bool = True,
                  keep_device: int | None = None) -> np.ndarray:
    """Lengths of a padded batch: ``0 <= seqlens[b] <= limit`` for every batch element.

    Parameters
    ----------
    name : str
        The argument's name for messages (``"seqlens_q"``, ``"seqlens_k"``).
    seqlens : integer array of shape `batch_shape`, or None
        None means every element uses the full `limit`.
    batch_shape : tuple
        The batch dimensions of ``q`` (``()`` for one unbatched problem).
    limit : int or None
        The padded length (``Nq`` or ``Nk``), which no length may exceed. None: no upper
        bound here (paged K/V, where `check_block_table` bounds the lengths); then
        `seqlens` must be given.
    limit_name : str
        How messages name `limit` (``"Nq"``, ``"Nk"``).
    check_values : bool
        False (``check_lengths=False``): only the dtype and shape are checked; the kernels
        clamp the values (`tileattn.options.VarlenLayout.descriptors`).
    keep_device : int or None
        With `check_values` False, an array on this GPU (the call's) stays there (see the
        module's docstring).

    Returns
    -------
    numpy.ndarray of int64, shape ``(prod(batch_shape),)`` (with `keep_device`, maybe a
    device array of int32 or int64)
    """
    batch = math.prod(batch_shape)
    if seqlens is None:
        return np.full(batch, limit, dtype=np.int64)
    values = _integer_array(name, seqlens, None if check_values else keep_device)
    if values.shape != tuple(batch_shape):
        raise ValueError(f"{name} must have the batch shape of q, {tuple(batch_shape)}, "
                         f"got shape {values.shape}")
    if not check_values:
        return values.reshape(batch)
    negative = values < 0
    if negative.any():
        index = _first(negative)
        raise ValueError(f"{name} must be >= 0, got {name}[{index}] = {values[index]}")
    if limit is not None and (values > limit).any():
        index = _first(values > limit)
        raise ValueError(f"{name} must be <= {limit_name} = {limit}, got "
                         f"{name}[{index}] = {values[index]}")
    return values.reshape(batch)


def check_cu_seqlens(name: str, cu_seqlens, total: int, total_name: str,
                     check_values: bool = True) -> np.ndarray:
    """Cumulative lengths of packed sequences: ``(S + 1,)`` integers from 0, non-decreasing,
    ending at `total` (``Nq_total`` or ``Nk_total``, the packed axis' length).

    Returns
    -------
    numpy.ndarray of int64, shape ``(S + 1,)``
    """
    values = _integer_array(name, cu_seqlens)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"{name} must have shape (S + 1,) with S >= 0 sequences, got shape "
                         f"{values.shape}")
    if not check_values:
        return values
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {values[0]}")
    decreasing = values[1:] < values[:-1]  # np.diff costs a few us more a call
    if decreasing.any():
        (s,) = _first(decreasing)
        raise ValueError(f"{name} must be non-decreasing, got {name}[{s}] = {values[s]} > "
                         f"{name}[{s + 1}] = {values[s + 1]}")
    if values[-1] != total:
        raise ValueError(f"{name} must end at {total_name} = {total}, got "
                         f"{name}[-1] = {values[-1]}")
    return values


def check_cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k, n_q_total: int, n_k_total: int,
                          check_values: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Both cumulative-length arrays (`check_cu_seqlens`), describing the same number of
    sequences. Returns them as int64 arrays."""
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, n_q_total, "q.shape[-2]",
                            check_values)
    cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, n_k_total, "k.shape[-2]",
                            check_values)
    if cu_k.shape != cu_q.shape:
        raise ValueError(f"cu_seqlens_k must have the shape of cu_seqlens_q, "
                         f"(S + 1,) = {cu_q.shape}, got shape {cu_k.shape}")
    return cu_q, cu_k


def check_page_pools(k_pages, v_pages) -> tuple[int, int]:
    """Page pools ``k (num_pages, Hkv, page_size, D)``, ``v (num_pages, Hkv, page_size, Dv)``
    with ``page_size >= 1``. Returns ``(num_pages, page_size)``."""
    if k_pages.ndim != 4:
        raise ValueError(f"k must be a page pool of shape (num_pages, Hkv, page_size, D) with "
                         f"block_table, got shape {tuple(k_pages.shape)}")
    num_pages, n_kv_heads, page_size, _ = k_pages.shape
    if v_pages.ndim != 4 or tuple(v_pages.shape[:3]) != (num_pages, n_kv_heads, page_size):
        raise ValueError(f"v must be a page pool of shape (num_pages, Hkv, page_size, Dv) = "
                         f"({num_pages}, {n_kv_heads}, {page_size}, Dv) like k, got shape "
                         f"{tuple(v_pages.shape)}")
    if page_size < 1:
        raise ValueError(f"page_size (k.shape[2]) must be >= 1, got {page_size}")
    return num_pages, page_size


def check_block_table(block_table, seqlens_k: np.ndarray, batch_shape: tuple, num_pages: int,
                      page_size: int, check_values: bool = True,
                      keep_device: int | None = None) -> np.ndarray:
    """A block table ``(*batch, max_pages)`` that holds every key of every batch element.

    Batch element ``b`` reads the first ``ceil(seqlens_k[b] / page_size)`` entries of its
    row; each must be a page id in ``[0, num_pages)``. The entries after those are never read
    and may hold anything (padding such as -1).

    Parameters
    ----------
    seqlens_k : int64 array of shape ``(prod(batch_shape),)``
        Already checked to be >= 0.
    check_values : bool
        False (``check_lengths=False``): only the dtype and shape are checked; kernels
        clamp page ids and lengths instead.
    keep_device : int or None
        As in `check_seqlens`.

    Returns
    -------
    numpy.ndarray of int64, shape ``(prod(batch_shape), max_pages)`` (with `keep_device`,
    maybe a device array of int32 or int64)
    """
    table = _integer_array("block_table", block_table, None if check_values else keep_device)
    if table.ndim != len(batch_shape) + 1 or table.shape[:-1] != tuple(batch_shape):
        raise ValueError(f"block_table must have shape (*batch, max_pages) with the batch "
                         f"shape of q, {tuple(batch_shape)}, got shape {table.shape}")
    max_pages = table.shape[-1]
    table = table.reshape(len(seqlens_k), max_pages)
    if not check_values:
        return table
    pages_used = -(-seqlens_k // page_size)
    too_short = pages_used > max_pages
    if too_short.any():
        (b,) = _first(too_short)
        raise ValueError(f"block_table is too short for seqlens_k: (flattened) batch element "
                         f"{b} has seqlens_k = {seqlens_k[b]} keys, which need "
                         f"{pages_used[b]} pages of page_size {page_size}, got max_pages = "
                         f"{max_pages}")
    used = np.arange(max_pages)[None, :] < pages_used[:, None]
    out_of_range = used & ((table < 0) | (table >= num_pages))
    if out_of_range.any():
        b, column = _first(out_of_range)
        raise ValueError(f"block_table entries must be page ids in [0, num_pages) = "
                         f"[0, {num_pages}), got block_table[{b}, {column}] = "
                         f"{table[b, column]} ((flattened) batch element {b} reads its first "
                         f"{pages_used[b]} entries)")
    return table


VARLEN_KEYWORDS = ("seqlens_q", "seqlens_k", "cu_seqlens_q", "cu_seqlens_k", "block_table")


def varlen_family(keywords: dict, *, backward: bool) -> str | None:
    """Which family the caller's length keywords name: ``"padded"``, ``"packed"``,
    ``"paged"``, or None (a dense call). Raises a `ValueError` naming the keyword for a
    combination SPEC does not define, and for ``block_table`` in `backward` (paged K/V is
    forward only)."""
    given = {name for name in VARLEN_KEYWORDS if keywords.get(name) is not None}
    if "block_table" in given and backward:
        raise ValueError("block_table is not accepted by backward: paged K/V is forward only "
                         "(SPEC); gather the keys into a padded batch and pass seqlens_k")
    packed = {"cu_seqlens_q", "cu_seqlens_k"} & given
    if len(packed) == 1:
        (name,) = packed
        other = "cu_seqlens_k" if name == "cu_seqlens_q" else "cu_seqlens_q"
        raise ValueError(f"{name} and {other} must be given together (packed sequences), "
                         f"got {name} without {other}")
    if packed:
        for name in ("seqlens_q", "seqlens_k", "block_table"):
            if name in given:
                raise ValueError(f"{name} cannot be combined with cu_seqlens_q and "
                                 f"cu_seqlens_k (packed sequences), got both")
        return "packed"
    if "block_table" in given:
        if "seqlens_k" not in given:
            raise ValueError("seqlens_k must be given with block_table (paged K/V), got None")
        return "paged"
    return "padded" if given else None


def check_packed_slopes(slopes, n_sequences: int, n_q_heads: int):
    """ALiBi slopes of packed sequences: shape ``(Hq,)`` or ``(S, Hq)`` (docs/varlen.md)."""
    shape = np.shape(arrays.to_host(arrays.to_native(slopes)))
    if shape not in ((n_q_heads,), (n_sequences, n_q_heads)):
        raise ValueError(f"alibi_slopes of packed sequences must have shape (Hq,) = "
                         f"({n_q_heads},) or (S, Hq) = ({n_sequences}, {n_q_heads}), "
                         f"got {shape}")
