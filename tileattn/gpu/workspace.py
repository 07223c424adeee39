"""Scratch memory of the split-KV forwards (the decode kernels' and the prefill's partial o
and lse, the decode's split counters): one buffer per (device, stream, dtype) that only
grows and is never freed, so a repeated call allocates nothing and a CUDA graph captured on
a stream replays into a buffer that stays valid (allocate it with one eager call before
capturing: the tests do)."""

from __future__ import annotations

import cupy

from ..arrays import dtype_name

_WORKSPACES: dict[tuple, object] = {}
# Outgrown workspaces stay allocated: a CUDA graph captured earlier still writes into its
# buffer when replayed. Growth doubles, so this holds less than the current one's size.
_OUTGROWN: list = []


def workspace(size: int, dtype):
    """`size` elements of scratch for the current (device, stream); grown (doubling), never
    shrunk or freed."""
    key = (cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr, dtype_name(dtype))
    buffer = _WORKSPACES.get(key)
    if buffer is None or buffer.size < size:
        if buffer is not None:
            _OUTGROWN.append(buffer)
        grown = max(size, 2 * buffer.size if buffer is not None else size, 1)
        buffer = cupy.empty(grown, dtype=dtype)
        _WORKSPACES[key] = buffer
    return buffer


_PARTIALS: dict[tuple, tuple] = {}


def partials(partial_size: int, lse_size: int, dtype) -> tuple:
    """The workspace's (partial o, partial lse) views, kept per workspace and sizes: a decode
    step is microseconds, and two CuPy views a call cost a few of them."""
    buffer = workspace(partial_size + lse_size, dtype)
    key = (buffer.data.ptr, partial_size, lse_size)
    views = _PARTIALS.get(key)
    if views is None:
        if len(_PARTIALS) >= 256:
            _PARTIALS.clear()
        views = (buffer[:partial_size], buffer[partial_size:partial_size + lse_size])
        _PARTIALS[key] = views
    return views


_COUNTERS: dict[tuple, object] = {}


def split_counters(count: int):
    """`count` uint32 counters for the current (device, stream), zero between launches: the
    decode kernel that merges its own splits counts each group's finished blocks in them,
    and the last block of a group sets its counter back to zero. Grown (doubling, zeroed on
    this stream, so before any launch queued after it), never shrunk or freed."""
    key = (cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr)
    buffer = _COUNTERS.get(key)
    if buffer is None or buffer.size < count:
        if buffer is not None:
            _OUTGROWN.append(buffer)
        grown = max(count, 2 * buffer.size if buffer is not None else count, 1)
        buffer = cupy.zeros(grown, dtype=cupy.uint32)
        _COUNTERS[key] = buffer
    return buffer
