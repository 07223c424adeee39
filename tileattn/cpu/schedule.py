"""How the parallel kernels share tasks among threads: longest task first, claimed on demand.

A causal query tile's cost grows with its row index (tile ``i`` of ``n`` computes about
``i + 1/2`` key tiles). Dealt round-robin to two threads, every odd tile went to the second
thread, which so did ``n/2`` key tiles more per head than the first: at N = 2048 with
512-row tiles, 5 against 3, and the first thread idled a quarter of the call
(bench/NOTES-cpu.md, v5). Ordering the tasks longest first and letting each thread claim the
next one when it is free (an atomic counter) ends both threads within one short task of each
other, whatever the mask, and also when the machine's other load slows one core.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic



@intrinsic
def claim_next(typingctx, counter):
    """Atomically ``counter[0] += 1``; returns the value before (a task index to run).

    Numba has no atomics; this is LLVM's ``atomicrmw add`` on the array's first element, so
    every task goes to exactly one thread however the threads interleave.
    """
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        return None

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", array.data, ir.Constant(ir.IntType(64), 1),
                                  "monotonic")

    return types.int64(counter), codegen


def _element(context, builder, signature, args):
    """A pointer to ``array[index]`` of an intrinsic's (array, index, ...) arguments."""
    array = context.make_array(signature.args[0])(context, builder, args[0])
    return builder.gep(array.data, [args[1]])


def _int64_array(array) -> bool:
    return isinstance(array, types.Array) and array.dtype == types.int64


@intrinsic
def load_acquire(typingctx, array, index):
    """``array[index]`` read atomically (acquire): a flag another thread writes."""
    if not _int64_array(array):
        return None

    def codegen(context, builder, signature, args):
        return builder.load_atomic(_element(context, builder, signature, args), "acquire", 8)

    return types.int64(array, types.intp), codegen


@intrinsic
def store_release(typingctx, array, index, value):
    """``array[index] = value`` atomically (release): what was written before is seen first."""
    if not _int64_array(array):
        return None

    def codegen(context, builder, signature, args):
        builder.store_atomic(args[2], _element(context, builder, signature, args), "release", 8)
        return context.get_dummy_value()

    return types.void(array, types.intp, types.int64), codegen


@intrinsic
def compare_exchange(typingctx, array, index, expected, new):
    """``array[index] = new`` if it holds `expected`, atomically; whether it did."""
    if not _int64_array(array):
        return None

    def codegen(context, builder, signature, args):
        pair = builder.cmpxchg(_element(context, builder, signature, args), args[2], args[3],
                               "acq_rel", "acquire")
        return builder.extract_value(pair, 1)

    return types.boolean(array, types.intp, types.int64, types.int64), codegen


def _read_modify_write(operation: str):
    """An intrinsic ``(array, index, value) -> old`` applying LLVM's atomicrmw `operation` to
    ``array[index]``."""

    @intrinsic
    def read_modify_write(typingctx, array, index, value):
        if not _int64_array(array):
            return None

        def codegen(context, builder, signature, args):
            return builder.atomic_rmw(operation, _element(context, builder, signature, args),
                                      args[2], "acq_rel")

        return types.int64(array, types.intp, types.int64), codegen

    return read_modify_write


exchange = _read_modify_write("xchg")  # array[index] = value; returns the value before
fetch_add = _read_modify_write("add")  # array[index] += value; returns the value before
