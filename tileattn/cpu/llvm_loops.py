"""The loop the micro-kernels written as LLVM IR share (`bf16_products`, `row_products`):
values carried through ``for index in range(count)`` as phi nodes, so that LLVM keeps them
in registers for the whole loop."""

from __future__ import annotations

import llvmlite.ir as ir


def carried_loop(builder: ir.IRBuilder, count, initial: list, step) -> list:
    """Emits ``for index in range(count)`` (`count` an i64) carrying the LLVM values
    `initial`: each trip's values are ``step(index, values)``, a list of the same length
    and types, computed in straight-line code. Returns the values after the loop (`initial`
    where ``count <= 0``), the builder placed after it."""
    i64 = ir.IntType(64)
    entry = builder.basic_block
    loop = builder.append_basic_block("carried.loop")
    done = builder.append_basic_block("carried.done")
    builder.cbranch(builder.icmp_signed("<=", count, ir.Constant(i64, 0)), done, loop)

    builder.position_at_end(loop)
    index = builder.phi(i64)
    index.add_incoming(ir.Constant(i64, 0), entry)
    carried = [builder.phi(value.type) for value in initial]
    for phi, value in zip(carried, initial):
        phi.add_incoming(value, entry)
    updated = step(index, carried)
    next_index = builder.add(index, ir.Constant(i64, 1))
    last = builder.basic_block
    index.add_incoming(next_index, last)
    for phi, value in zip(carried, updated):
        phi.add_incoming(value, last)
    builder.cbranch(builder.icmp_signed("<", next_index, count), loop, done)

    builder.position_at_end(done)
    results = []  # every phi before any other instruction, as LLVM requires
    for value, new in zip(initial, updated):
        result = builder.phi(value.type)
        result.add_incoming(value, entry)
        result.add_incoming(new, last)
        results.append(result)
    return results
