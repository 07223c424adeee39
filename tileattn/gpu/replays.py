"""A validated GPU call repeated on new device addresses.

The JAX adapter's callbacks run one compiled problem again and again: XLA fixed the
shapes, strides and dtypes when it compiled the program, and only the buffers' addresses
change from call to call. A `Replay` runs the launches that the plan cache keeps for that
problem (`operands.remember`) on those addresses, as ints: no validation, no plan lookup,
no CuPy views or new outputs, which are most of a small call's host time (a tiny forward
through `tileattn.forward` costs ~80 us of host time on the H100 machine;
bench/experiments/host_profile_gpu.py).
"""

from __future__ import annotations

from functools import partial

import cupy

from ..options import AttentionOptions
from .launch_backward import BackwardPlan, backward_plan_key, new_bytes
from .operands import cached, contiguous_strides, forward_plan_key

# The widest copy any kernel assumes of a row (operands.row_alignment); outputs need two
# elements. XLA's and CuPy's buffers start 256-byte aligned.
_ALIGNMENT = 16


class Replay:
    """A cached plan run on device addresses on the stream current at its creation:
    forward ``(q, k, v, o, lse)``, backward ``(do, q, k, v, o, lse, dq, dk, dv)``, in the
    layouts of the validated call it repeats. A backward keeps its scratch (D, flags) for
    every call (calls on one stream run in order), from ``allocate(bytes) -> address``
    where given: an allocator that knows CUDA graph capture (torch's), whose memory the
    caller keeps alive as long as the replay."""

    def __init__(self, plan, backward: bool, allocate=None):
        self._plan = plan
        self._stream = cupy.cuda.get_current_stream().ptr
        self._held = []
        if allocate is None:
            allocate = partial(new_bytes, self._held)
        self._scratch = (plan.scratch(allocate),) if backward else ()

    def __call__(self, *addresses: int) -> bool:
        """Runs the plan; False, having run nothing, where an address is not aligned as the
        plan assumes or the current stream is not the replay's."""
        if cupy.cuda.get_current_stream().ptr != self._stream:
            return False
        for address in addresses:
            if address % _ALIGNMENT:
                return False
        self._plan(*addresses, *self._scratch)
        return True


def replay(function_name: str, tensors: dict, options: AttentionOptions,
           allocate=None, outputs: dict | None = None) -> Replay | None:
    """The replay of a validated dense call that has run once (its plan is cached), or None
    for calls whose plans are not cached (ALiBi, dropout, variable-length, copied inputs).
    `outputs`: the call's output buffers (the backend's views), whose strides the
    launches took."""
    if options.varlen is not None:
        return None
    if function_name == "forward":
        q, k, v = (tensors[n] for n in "qkv")
        out = (outputs or {}).get("out")
        o_strides = (contiguous_strides(q.shape[:3] + (v.shape[3],), q.itemsize)
                     if out is None else out.strides)
        launches = cached(forward_plan_key(options, q, k, v, o_strides), q, k, v)
        return None if launches is None else Replay(launches[0], backward=False)
    arrays = [tensors[n] for n in ("do", "q", "k", "v", "o")]
    given = tuple((outputs or {}).get(name) for name in ("dq_out", "dk_out", "dv_out"))
    launches = cached(backward_plan_key(*arrays, options, given), *arrays)
    lse = tensors["lse"]
    if (launches is None or not isinstance(launches[0], BackwardPlan)
            or lse.dtype != cupy.float32 or not lse.flags.c_contiguous):
        return None
    return Replay(launches[0], backward=True, allocate=allocate)
