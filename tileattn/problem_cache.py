"""Validated problems remembered per call signature, so that a repeated call skips validation.

Everything `validation.validate` checks and derives for a dense call depends only on the
arrays' types, shapes, strides, dtypes and devices (and, for host output buffers, whether
they are writeable) and on the option values, never on the arrays' contents, except the
output buffers' addresses: their alignment and overlap with the inputs are checked on
every call (`validation.check_output_addresses`). A call whose signature was validated
before therefore gets that problem again with its own arrays in it, in a few microseconds
instead of the ~25-40 that validation costs: on the GPU a small call or a decode step is
counted in tens of microseconds of host time (bench/NOTES-gpu.md).

Host torch tensors (the torch adapter on the CPU) are remembered through their NumPy views
(`arrays.to_native`), under their own type, so that results still go back as tensors.
Variable-length and paged calls are remembered when their lengths and table are CuPy or
NumPy arrays: what validation derives from them besides their contents depends on their
types, shapes and dtypes only, so a remembered call re-derives just its `VarlenLayout`
around the new arrays (`validation.with_lengths`), their contents checked afresh unless
``check_lengths=False`` (then, as a decode loop's step needs, not even read). Calls this
does not remember, validated every time: lengths given as other objects (lists, tensors),
ALiBi slopes (an array), other arrays than those in native byte order, and option values
that are not hashable.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np

from . import arrays
from .validation import (Problem, backend_views, check_output_addresses, heads_first,
                         output_view, validate, with_lengths)

_LIMIT = 256  # signatures remembered; the whole cache is dropped when it is full
_PROBLEMS: dict = {}
_FORWARD_NAMES = ("q", "k", "v")
_BACKWARD_NAMES = ("q", "k", "v", "do", "o", "lse")


def _array_signature(array):
    """What validation reads of a NumPy or CuPy array, or None for one this does not
    remember (a non-native byte order)."""
    if type(array) is np.ndarray:
        if not array.dtype.isnative:
            return None
        return array.shape, array.strides, array.dtype, array.flags.writeable
    return array.shape, array.strides, array.dtype, array.data.device_id


def _natives(arrays_in: tuple) -> tuple | None:
    """The arrays as validation reads them (NumPy or CuPy), or None for kinds this does not
    remember: host torch tensors become their NumPy views, which is what validation makes
    of them too; CUDA tensors and JAX arrays would cost a DLPack exchange here and another
    in validation."""
    cupy = sys.modules.get("cupy")
    natives = []
    for array in arrays_in:
        kind = type(array)
        if kind is not np.ndarray and (cupy is None or kind is not cupy.ndarray):
            if arrays.library_of(array) != "torch" or array.device.type != "cpu":
                return None
            array = arrays.to_native(array)
        natives.append(array)
    return tuple(natives)


def _signature(arrays_in: tuple, natives: tuple, layout, check_lengths, options: dict,
               extra: tuple = ()):
    """The key of a call, or None when it is not remembered; `extra` joins the key as it
    is (the output names and the lengths' signature: no types to tell apart there)."""
    if options.get("alibi_slopes") is not None:
        return None
    signatures = tuple(map(_array_signature, natives))
    if None in signatures:
        return None
    values = tuple(options.values())
    # The types too, inside tuples as well: causal=1 and causal=True compare (and hash)
    # equal, as do window=(True, 1) and (1, 1), but validation rejects the bool and the
    # int; and a tensor's results go back as tensors.
    return (layout, check_lengths, type(check_lengths), tuple(options), values,
            tuple(map(_types_of, values)), tuple(map(type, arrays_in)), signatures, extra)


def _types_of(value):
    """The type of `value`, and of each item of a tuple or list, recursively."""
    if isinstance(value, (tuple, list)):
        return type(value), tuple(map(_types_of, value))
    return type(value)


def validate_call(q, k, v, *, do=None, o=None, lse=None, layout="bhsd", outputs=None,
                  varlen=None, check_lengths=True, **options) -> Problem:
    """`validation.validate` with the same arguments, remembered per call signature."""
    lengths = None
    if varlen is not None:
        lengths = _lengths_signature(varlen)
        if lengths is None:
            return validate(q, k, v, do=do, o=o, lse=lse, layout=layout, outputs=outputs,
                            varlen=varlen, check_lengths=check_lengths, **options)
    arrays_in = (q, k, v) if do is None else (q, k, v, do, o, lse)
    given = {name: b for name, b in outputs.items() if b is not None} if outputs else {}
    natives = _natives(arrays_in + tuple(given.values()))
    key = (None if natives is None else
           _signature(arrays_in + tuple(given.values()), natives, layout, check_lengths,
                      options, (tuple(given), lengths)))
    try:
        remembered = _PROBLEMS.get(key) if key is not None else None
    except TypeError:  # an option value that is not hashable, e.g. window given as a list
        key = remembered = None
    if remembered is None:
        problem = validate(q, k, v, do=do, o=o, lse=lse, layout=layout, outputs=outputs,
                           varlen=varlen, check_lengths=check_lengths, **options)
        if key is not None:
            if len(_PROBLEMS) >= _LIMIT:
                _PROBLEMS.clear()
            # Without its arrays, which the cache must not keep alive.
            _PROBLEMS[key] = (problem.tensors["q"].shape[0],
                              replace(problem, tensors={}, outputs={}))
        return problem
    batch, template = remembered
    named = dict(zip(_FORWARD_NAMES if do is None else _BACKWARD_NAMES, natives))
    given = dict(zip(given, natives[len(named):]))
    layout_of = template.layout
    if layout_of.sequence_first:
        named = heads_first(named)
    tensors = backend_views(named, batch, layout_of.single_head)
    check_output_addresses(given, named, layout_of.memory)
    views = {name: output_view(name, array, batch, layout_of.single_head,
                               layout_of.sequence_first)[1] for name, array in given.items()}
    options_of = (template.options if varlen is None
                  else with_lengths(template, varlen, do is not None,
                                    natives[0].data.device_id
                                    if arrays.memory_of(natives[0]) == "cuda" else None,
                                    check_lengths))
    return Problem(tensors, layout_of, options_of, template.dtype, template.n_q_heads,
                   template.n_kv_heads, template.n_q, template.n_k, template.head_dim,
                   template.value_dim, views)


def _lengths_signature(varlen: dict) -> tuple | None:
    """The signature of a call's lengths and table when each is a CuPy or a NumPy array
    (what validation derives from them besides their contents, which a remembered call
    checks afresh unless unchecked), else None."""
    cupy = sys.modules.get("cupy")
    signature = []
    for name, array in varlen.items():
        if array is None:
            continue
        if type(array) is np.ndarray:
            signature.append((name, np.ndarray, array.shape, array.strides, array.dtype))
            continue
        if cupy is None or type(array) is not cupy.ndarray:
            return None
        signature.append((name, cupy.ndarray, array.shape, array.strides, array.dtype,
                          array.data.device_id))
    return tuple(signature)
