"""Validated problems remembered per call signature, so that a repeated call skips validation.

Everything `validation.validate` checks and derives for a dense call depends only on the
arrays' types, shapes, strides, dtypes and devices (and, for host output buffers, whether
they are writeable) and on the option values, never on the arrays' contents, except the
output buffers' addresses: their alignment and overlap with the inputs are checked on
every call (`validation.check_output_addresses`). A call whose signature was validated
before therefore gets that problem again with its own arrays in it, in a few microseconds
instead of the ~25-40 that validation costs: on the GPU a small call or a decode step is
counted in tens of microseconds of host time (bench/NOTES-gpu.md), and so is a small call
on the CPU (bench/NOTES-cpu.md, session 26: the key and the remembered problem are built
from as few Python objects as the checks allow, ~5 us a call on the 2-core host).

A remembered call without lengths or output buffers goes further (`dense_call`): its
arrays, in the backends' order, and the remembered options go to the backend directly, as
`api.run_forward` would pass them, past the problem record and the dispatch's steps.

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
from operator import attrgetter

import numpy as np

from . import arrays
from .options import evolve
from .validation import (Problem, backend_views, check_output_addresses, heads_first,
                         other_readers, output_view, validate, with_lengths)

_LIMIT = 256  # signatures remembered; the whole cache is dropped when it is full
_PROBLEMS: dict = {}
_FORWARD_NAMES = ("q", "k", "v")
_BACKWARD_NAMES = ("q", "k", "v", "do", "o", "lse")
OPTION_NAMES = ("causal", "window", "scale", "softcap", "alibi_slopes", "dropout_p", "seed",
                "block_q", "block_k", "deterministic")
"""The option keywords of `validation.validate`, in the order `remembered_problem` takes
their values."""
_ALIBI = OPTION_NAMES.index("alibi_slopes")
# Option values of these types need no more than their type in the key; others (a window
# tuple) also the types of their items (`_types_of`).
_SCALAR_TYPES = frozenset({type(None), bool, int, float, str})
_HOST_SIGNATURE = attrgetter("shape", "strides", "dtype")


def _array_signature(array):
    """What validation reads of a NumPy or CuPy array (of a host output buffer, also
    whether it is writeable: `_signature`)."""
    if type(array) is np.ndarray:
        return _HOST_SIGNATURE(array)
    return array.shape, array.strides, array.dtype, array.data.device_id


def _natives(arrays_in: tuple) -> tuple | None:
    """The arrays as validation reads them (NumPy or CuPy), or None for kinds this does not
    remember: host torch tensors become their NumPy views, which is what validation makes
    of them too; CUDA tensors and JAX arrays would cost a DLPack exchange here and another
    in validation. `arrays_in` itself when all are NumPy arrays."""
    for array in arrays_in:
        if type(array) is not np.ndarray:
            break
    else:  # the common case on the host
        return arrays_in
    cupy = sys.modules.get("cupy")
    natives = []
    for array in arrays_in:
        kind = type(array)
        if kind is not np.ndarray and (cupy is None or kind is not cupy.ndarray):
            if arrays.library_of(array) != "torch" or array.device.type != "cpu":
                return None
            try:
                array = arrays.to_native(array)
            except TypeError:  # validation refuses it, naming the argument
                return None
        natives.append(array)
    return tuple(natives)


def _signature(arrays_in: tuple, natives: tuple, n_inputs: int, layout, check_lengths,
               options: tuple, extra: tuple):
    """The key of a call whose first `n_inputs` arrays are inputs and the others output
    buffers; `extra` joins the key as it is (the output names and the lengths' signature:
    no types to tell apart there). Arrays in another byte order get keys too, which no
    call remembers (`_remember`): their dtypes differ from the native ones'."""
    signatures = tuple(map(_HOST_SIGNATURE if natives is arrays_in else _array_signature,
                           natives))
    writeable = () if len(natives) == n_inputs else tuple(
        array.flags.writeable for array in natives[n_inputs:] if type(array) is np.ndarray)
    # The types too, inside tuples as well: causal=1 and causal=True compare (and hash)
    # equal, as do window=(True, 1) and (1, 1), but validation rejects the bool and the
    # int; and a tensor's results go back as tensors. Plain scalars give the same tuple
    # either way (`_types_of`), so a value's key does not depend on the way taken.
    kinds = tuple(map(type, options))
    if not _SCALAR_TYPES.issuperset(kinds):
        kinds = tuple(map(_types_of, options))
    return (layout, check_lengths, type(check_lengths), options, kinds,
            tuple(map(type, arrays_in)), signatures, writeable, extra)


def _types_of(value):
    """The type of `value`, and of each item of a tuple or list, recursively."""
    if isinstance(value, (tuple, list)):
        return type(value), tuple(map(_types_of, value))
    return type(value)


def validate_call(q, k, v, *, do=None, o=None, lse=None, layout="bhsd", outputs=None,
                  varlen=None, check_lengths=True, **options) -> Problem:
    """`validation.validate` with the same arguments, remembered per call signature
    (`remembered_problem`)."""
    if options.keys() != set(OPTION_NAMES):  # validation names what is missing or extra
        return validate(q, k, v, do=do, o=o, lse=lse, layout=layout, outputs=outputs,
                        varlen=varlen, check_lengths=check_lengths, **options)
    return remembered_problem((q, k, v) if do is None else (q, k, v, do, o, lse),
                              tuple(options[name] for name in OPTION_NAMES), layout, outputs,
                              varlen, check_lengths)


def dense_call(arrays_in: tuple, options: tuple, layout="bhsd", check_lengths=True):
    """For a call without lengths or output buffers (what `tileattn.forward` and `backward`
    make of most calls): ``(natives, key, template, tensors)``. Where such a call was
    remembered under `key` and is not empty, `template` is its problem without arrays and
    `tensors` the arrays in the backends' 4-D order (`natives` themselves where the backends
    read the caller's arrays as they are, 4-D "bhsd"), so that the caller may pass them and
    ``template.options`` to its backend directly, skipping what `remembered_problem` and
    `api.run_forward` add on the way (~3-5 us of a small call's ~12-19 on the 2-core
    development host, bench/NOTES-cpu.md, session 41); else both None, and ``(natives,
    key)`` go to `remembered_problem` as `dense`, which then need not make them again.
    `key` is None where such calls are not remembered."""
    natives = _natives(arrays_in)
    if natives is None or options[_ALIBI] is not None:
        return natives, None, None, None
    key = _signature(arrays_in, natives, len(arrays_in), layout, check_lengths, options,
                     _DENSE_EXTRA)
    try:
        remembered = _PROBLEMS.get(key)
    except TypeError:  # an option value that is not hashable, e.g. window given as a list
        return natives, None, None, None
    if remembered is None or not remembered[3]:
        return natives, key, None, None
    batch, as_given, template, _ = remembered
    if as_given:
        return natives, key, template, natives
    names = _FORWARD_NAMES if len(arrays_in) == 3 else _BACKWARD_NAMES
    named = dict(zip(names, natives))
    if template.layout.sequence_first:
        named = heads_first(named)
    views = backend_views(named, batch, template.layout.single_head)
    return natives, key, template, tuple(views[name] for name in names)


_DENSE_EXTRA = ((), None)  # `_signature`'s `extra` of a call without buffers or lengths


def remembered_problem(arrays_in: tuple, options: tuple, layout="bhsd", outputs=None,
                       varlen=None, check_lengths=True, dense=None) -> Problem:
    """`validate_call` of `arrays_in`, ``(q, k, v)`` or ``(q, k, v, do, o, lse)``, and the
    option values in `OPTION_NAMES` order: what `tileattn.forward` and `backward` call,
    since sixteen keywords, ten of them gathered into a dict, cost ~3 us a call on the
    2-core development host (bench/NOTES-cpu.md, session 26). `dense`: `dense_call`'s
    ``(natives, key)`` of these arguments, where the caller asked it (no lengths or
    buffers)."""
    if dense is not None:
        (natives, key), given = dense, {}
    else:
        lengths = None
        if varlen is not None:
            lengths = _lengths_signature(varlen)
            if lengths is None:
                return _validate(arrays_in, options, layout, outputs, varlen, check_lengths)
        given = {name: b for name, b in outputs.items() if b is not None} if outputs else {}
        every_array = arrays_in + tuple(given.values()) if given else arrays_in
        natives = _natives(every_array)
        key = None
        if natives is not None and options[_ALIBI] is None:
            key = _signature(every_array, natives, len(arrays_in), layout, check_lengths,
                             options, (tuple(given), lengths))
    try:
        remembered = _PROBLEMS.get(key)
    except TypeError:  # an option value that is not hashable, e.g. window given as a list
        key = remembered = None
    names = _FORWARD_NAMES if len(arrays_in) == 3 else _BACKWARD_NAMES
    if remembered is None:
        problem = _validate(arrays_in, options, layout, outputs, varlen, check_lengths)
        if key is not None:
            _remember(key, problem, names, natives, tuple(given), varlen is None)
        return problem
    batch, as_given, template, _ = remembered
    named = dict(zip(names, natives))
    given = dict(zip(given, natives[len(named):]))
    layout_of = template.layout
    if given:
        check_output_addresses(given, {**named, **other_readers(varlen, None,
                                                                 layout_of.memory)},
                               layout_of.memory)
    if as_given:
        return evolve(template, tensors=named, outputs=given)
    if layout_of.sequence_first:
        named = heads_first(named)
    tensors = backend_views(named, batch, layout_of.single_head)
    views = {name: output_view(name, array, batch, layout_of.single_head,
                               layout_of.sequence_first)[1] for name, array in given.items()}
    options_of = (template.options if varlen is None
                  else with_lengths(template, varlen, len(arrays_in) > 3,
                                    natives[0].data.device_id
                                    if arrays.memory_of(natives[0]) == "cuda" else None,
                                    check_lengths))
    return evolve(template, tensors=tensors, options=options_of, outputs=views)


def _validate(arrays_in: tuple, options: tuple, layout, outputs, varlen,
              check_lengths) -> Problem:
    """`validation.validate` of `remembered_problem`'s arguments."""
    q, k, v, *more = arrays_in
    backward_of = dict(zip(("do", "o", "lse"), more))
    return validate(q, k, v, **backward_of, layout=layout, outputs=outputs, varlen=varlen,
                    check_lengths=check_lengths, **dict(zip(OPTION_NAMES, options)))


def _remember(key, problem: Problem, names: tuple, natives: tuple, output_names: tuple,
              dense: bool) -> None:
    """Keep a validated problem, without its arrays (which the cache must not keep alive),
    under `key`, unless an array is not in the machine's byte order: validation gave the
    backends a native copy of it, which a repeated call would have to make again. For a
    `dense` call (no lengths), also whether the backends read the caller's arrays and
    write its output buffers (`output_names`, the arrays after the inputs) themselves (4-D,
    "bhsd"): a repeated call then only names them (and checks the buffers' addresses)."""
    if not all(array.dtype.isnative for array in natives):
        return
    if len(_PROBLEMS) >= _LIMIT:
        _PROBLEMS.clear()
    as_given = dense and all(problem.tensors[name] is array
                             for name, array in zip(names, natives)) and all(
        problem.outputs.get(name) is array
        for name, array in zip(output_names, natives[len(names):]))
    # Last, whether `dense_call` may hand the template to the caller: no lengths, no output
    # buffers, and the problem not empty (which `api.run_forward` answers itself).
    _PROBLEMS[key] = (problem.tensors["q"].shape[0], as_given,
                      replace(problem, tensors={}, outputs={}),
                      dense and not output_names and not problem.is_empty)


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
