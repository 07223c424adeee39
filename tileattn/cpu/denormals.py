"""Subnormal numbers flushed to zero inside the kernels (x86's FTZ and DAZ bits).

A softmax whose scores span more than ~87 (ALiBi's distance penalties; a sharp trained
head) makes probabilities below float32's smallest normal number, and their products with
V in the matrix products below it again. x86 cores take a microcode assist of ~100 cycles
for each subnormal operand or result: an ALiBi forward with slopes of 1 took 1.5x the time
of the same call without ALiBi (bench/NOTES-cpu.md, session 10). Such terms are below 2^-126
of the row's largest, far under any float32 result's rounding, so each kernel sets the
flush bits of its thread's MXCSR on entry and puts the caller's back on exit (the caller's
NumPy keeps IEEE subnormals), as GPUs flush them in their fast paths. Elsewhere than x86-64
both functions do nothing.
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_X86 = platform.machine().lower() in ("x86_64", "amd64")
_FLUSH_BITS = 0x8040  # FTZ (bit 15): subnormal results become 0; DAZ (bit 6): operands too


def _load_and_store(builder):
    """llvm.x86.sse.ldmxcsr and stmxcsr, which read and write the MXCSR through memory."""
    function_type = ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer()])
    return tuple(cgutils.get_or_insert_function(builder.module, function_type,
                                                f"llvm.x86.sse.{name}mxcsr")
                 for name in ("ld", "st"))


def _slot(builder):
    """An int32 stack slot and its address as the intrinsics take it."""
    slot = cgutils.alloca_once(builder, ir.IntType(32))
    return slot, builder.bitcast(slot, ir.IntType(8).as_pointer())


@intrinsic
def flush_subnormals(typingctx):
    """Set FTZ and DAZ on this thread; returns the previous MXCSR for `restore_subnormals`."""

    def codegen(context, builder, signature, args):
        int32 = ir.IntType(32)
        if not _X86:
            return ir.Constant(int32, 0)
        load, store = _load_and_store(builder)
        slot, address = _slot(builder)
        builder.call(store, [address])
        previous = builder.load(slot)
        builder.store(builder.or_(previous, ir.Constant(int32, _FLUSH_BITS)), slot)
        builder.call(load, [address])
        return previous

    return types.int32(), codegen


@intrinsic
def restore_subnormals(typingctx, previous):
    """Put back the MXCSR that `flush_subnormals` returned."""
    if previous != types.int32:
        return None

    def codegen(context, builder, signature, args):
        if _X86:
            load, _ = _load_and_store(builder)
            slot, address = _slot(builder)
            builder.store(args[0], slot)
            builder.call(load, [address])
        return context.get_dummy_value()

    return types.none(types.int32), codegen
