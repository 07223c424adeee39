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
