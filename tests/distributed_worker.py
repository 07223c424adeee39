"""One rank of the MPI tests (tests/test_distributed_mpi.py starts it under mpiexec).

    mpiexec -n 2 python tests/distributed_worker.py SCENARIO [BACKEND]

Scenarios:
    exact       every option set, both layouts, forward and backward: float64 within 1e-12
                relative of the golden model, float32 and float16 within tileattn.testing's
                tolerances (BACKEND, default "cpu")
    mismatch    shards, dtypes and options that differ across ranks, and arguments invalid on
                one rank: every rank must raise the same ValueError
    shard       shard/unshard round trips and N that does not divide
    nccl        CuPy arrays over NCCL (one GPU per rank, group.local_rank): a few cases in
                every dtype, and a group of one equal to tileattn.forward value for value

Each rank prints ``rank R: ...`` lines and ``rank R: done`` at the end; any failure raises,
and the launcher's exit status is non-zero.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from distributed_cases import OPTION_SETS, check_case, problem

import tileattn
import tileattn.distributed as td


def say(group, message):
    print(f"rank {group.rank}: {message}", flush=True)


def exact(group, backend):
    dtypes = [np.float64, np.float32, np.float16]
    for dtype in dtypes:
        for layout in td.LAYOUTS:
            names = list(OPTION_SETS) if dtype != np.float16 else ["causal",
                                                                   "causal-alibi-dropout"]
            for options_name in names:
                start = time.perf_counter()
                check_case(group, dtype=np.dtype(dtype), options_name=options_name,
                           layout=layout, backend=backend)
                say(group, f"ok {np.dtype(dtype).name} {layout} {options_name} "
                    f"({time.perf_counter() - start:.2f} s)")
    for layout in td.LAYOUTS:
        check_case(group, dtype=np.dtype(np.float64), options_name="causal-window",
                   layout=layout, backend=backend, n_q=24, n_k=40)
        say(group, f"ok float64 {layout} Nq=24 Nk=40")


def _expect_same_error(group, label, function, expected):
    try:
        function()
    except ValueError as error:
        message = str(error)
    else:
        raise AssertionError(f"{label}: no ValueError on rank {group.rank}")
    messages = group.allgather(message)
    assert all(m == messages[0] for m in messages), f"{label}: ranks differ: {messages}"
    assert expected in message, f"{label}: {expected!r} not in {message!r}"
    say(group, f"ok {label}: {message}")


def mismatch(group):
    q, k, v, do = problem(np.float64, n_q=24, n_k=24)
    local = [td.shard(a, group, layout="zigzag") for a in (q, k, v, do)]
    rank = group.rank

    def shape():
        q_local = local[0][..., : 4 if rank == 1 else 6, :]
        td.forward(q_local, *local[1:3], group=group, backend="reference")

    def dtype():
        q_local = local[0].astype(np.float32) if rank == 1 else local[0]
        td.forward(q_local, *local[1:3], group=group, backend="reference")

    def option():
        td.forward(*local[:3], group=group, backend="reference", causal=rank == 0)

    def invalid():
        td.forward(*local[:3], group=group, backend="reference", softcap=-1.0 * rank)

    def backward():
        o, lse = td.forward(*local[:3], group=group, backend="reference", return_lse=True)
        td.backward(local[3], *local[:3], o, lse if rank != 1 else lse[..., :-2],
                    group=group, backend="reference")

    _expect_same_error(group, "shape", shape, "every rank must pass the same q.shape")
    _expect_same_error(group, "dtype", dtype, "q.dtype")
    _expect_same_error(group, "option", option, "every rank must pass the same causal")
    _expect_same_error(group, "invalid", invalid, "softcap must be >= 0")
    _expect_same_error(group, "backward", backward, "lse must have shape")


def shard(group):
    x = np.arange(2 * 3 * 8 * group.size * 5, dtype=np.float32).reshape(2, 3, -1, 5)
    for layout in td.LAYOUTS:
        local = td.shard(x, group, layout=layout)
        assert np.array_equal(td.unshard(local, group, layout=layout), x), layout
        lse = x[..., 0]
        assert np.array_equal(td.unshard(td.shard(lse, group, layout=layout, axis=-1), group,
                                         layout=layout, axis=-1), lse)
    odd = np.zeros((3, 2 * group.size + 1, 4))
    for layout in td.LAYOUTS:
        try:
            td.shard(odd, group, layout=layout)
        except ValueError as error:
            assert f"layout={layout!r}" in str(error), str(error)
        else:
            raise AssertionError(f"{layout}: no ValueError for N = {odd.shape[-2]}")
    say(group, "ok shard/unshard")


def _same_values(got, want) -> bool:
    import cupy

    got, want = got.astype(cupy.float64), want.astype(cupy.float64)
    return bool(((got == want) | (cupy.isnan(got) & cupy.isnan(want))).all())


def nccl(group):
    import cupy

    from tileattn.testing import bfloat16

    cupy.cuda.Device(group.local_rank).use()
    dtypes = [np.float16] + ([bfloat16()] if bfloat16() is not None else []) + [
        np.float32, np.float64]
    for dtype in dtypes:
        for layout in td.LAYOUTS:
            for options_name in ("causal", "causal-alibi-dropout", "plain"):
                check_case(group, dtype=np.dtype(dtype), options_name=options_name,
                           layout=layout, backend="gpu", to_memory=cupy.asarray,
                           to_host=lambda a: a.get())
                say(group, f"ok nccl {np.dtype(dtype).name} {layout} {options_name}")
    if group.size == 1:
        q, k, v, do = (cupy.asarray(a) for a in problem(np.float16))
        o, lse = td.forward(q, k, v, group=group, causal=True, return_lse=True)
        o_one, lse_one = tileattn.forward(q, k, v, causal=True, return_lse=True)
        grads = td.backward(do, q, k, v, o, lse, group=group, causal=True)
        grads_one = tileattn.backward(do, q, k, v, o_one, lse_one, causal=True)
        names = ("o", "lse", "dq", "dk", "dv")
        # Equal values, NaN where NaN: the ring's float32 accumulators start at +0, so a -0
        # of the one-device result comes back +0 (the same number).
        differ = [name for name, got, want in zip(names, (o, lse, *grads),
                                                  (o_one, lse_one, *grads_one))
                  if not _same_values(got, want)]
        assert not differ, f"a group of one differs from tileattn.forward/backward: {differ}"
        say(group, "ok nccl group of one equals tileattn.forward/backward value for value")


def _abort_on_error(kind, value, traceback):
    """A rank that fails ends every rank (they may be waiting for it in the ring)."""
    sys.__excepthook__(kind, value, traceback)
    sys.stderr.flush()
    if "mpi4py.MPI" in sys.modules:
        sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(1)


def main():
    sys.excepthook = _abort_on_error
    scenario = sys.argv[1]
    backend = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    group = td.init()
    say(group, f"{group!r}")
    start = time.perf_counter()
    if scenario == "exact":
        exact(group, backend)
    elif scenario == "mismatch":
        mismatch(group)
    elif scenario == "shard":
        shard(group)
    elif scenario == "nccl":
        nccl(group)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    say(group, f"done {scenario} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
