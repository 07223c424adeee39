"""CPU-backend specifics; the shared behaviour is in test_backend_suite.py (``-k cpu``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("numba")

import tileattn  # noqa: E402
from tileattn import reference  # noqa: E402
from tileattn.dropout import dropout_key, dropout_threshold, keep_mask  # noqa: E402
from tileattn.options import AttentionOptions, Blocks  # noqa: E402
from tileattn.testing import assert_attention_close, bfloat16  # noqa: E402

cpu = pytest.importorskip("tileattn.cpu")

from tileattn.cpu import blocks as cpu_blocks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _inputs(shape_q, shape_k, shape_v, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(s).astype(dtype) for s in (shape_q, shape_k, shape_v))


def _golden(q, k, v, **options):
    q64, k64, v64 = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    return tileattn.forward(q64, k64, v64, backend="reference", return_lse=True, **options)


def _golden_grads(do, q, k, v, o, **options):
    """The golden gradients for the `o` the CPU backward was given (its D = rowsum(do * o))."""
    q64, k64, v64, do64, o64 = (np.asarray(a, dtype=np.float64) for a in (q, k, v, do, o))
    lse = tileattn.forward(q64, k64, v64, backend="reference", return_lse=True, **options)[1]
    return tileattn.backward(do64, q64, k64, v64, o64, lse, backend="reference", **options)


# --------------------------------------------------------------------------- threads, cache


def test_eight_python_threads_at_once_get_correct_results():
    problems = [_inputs((2, 4, 150, 32), (2, 2, 170, 32), (2, 2, 170, 24), seed=s)
                for s in range(8)]
    results, errors = [None] * 8, []
    start = threading.Barrier(8)

    def work(index):
        try:
            q, k, v = problems[index]
            start.wait()
            for _ in range(3):
                o, lse = tileattn.forward(q, k, v, causal=index % 2 == 1, backend="cpu",
                                          return_lse=True)
                grads = tileattn.backward(np.ones_like(o), q, k, v, o, lse,
                                          causal=index % 2 == 1, backend="cpu")
            results[index] = (o, grads)
        except BaseException as error:  # reported below, on the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for index, (o, grads) in enumerate(results):
        q, k, v = problems[index]
        options = {"causal": index % 2 == 1}
        assert_attention_close(o, _golden(q, k, v, **options)[0], np.float32, name="o")
        for name, grad, golden in zip(("dq", "dk", "dv"), grads,
                                      _golden_grads(np.ones_like(o), q, k, v, o, **options)):
            assert_attention_close(grad, golden, np.float32, name=name)


_FIRST_CALL = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    import numpy as np
    import tileattn
    from numba.core.registry import CPUDispatcher
    q = np.random.default_rng(0).standard_normal((1, 2, 64, 32)).astype(np.float32)
    o, lse = tileattn.forward(q, q, q, backend="cpu", return_lse=True)
    tileattn.backward(o, q, q, q, o, lse, backend="cpu")
    hits = misses = 0
    for name, module in list(sys.modules.items()):
        if name.startswith("tileattn.cpu"):
            for value in vars(module).values():
                if isinstance(value, CPUDispatcher) and value.signatures:
                    hits += sum(value.stats.cache_hits.values())
                    misses += sum(value.stats.cache_misses.values())
    print(hits, misses)
""")


def test_second_process_loads_every_kernel_from_the_on_disk_cache():
    # Deterministic stand-in for "a second process's first call is fast": it is fast exactly when
    # no kernel compiles. The time itself is measured by bench/first_call_cpu.py, not asserted here.
    code = _FIRST_CALL.format(root=str(ROOT))

    def cache_hits_and_misses():
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=900, check=True)
        hits, misses = done.stdout.strip().splitlines()[-1].split()
        return int(hits), int(misses), done.stderr

    cache_hits_and_misses()  # compiles and caches, unless an earlier run already did
    hits, misses, stderr = cache_hits_and_misses()
    assert misses == 0
    assert hits >= 3  # the forward, the row terms and the backward kernels
    assert "tileattn: compiling" not in stderr  # the compile notice only comes on a miss


def test_import_tileattn_does_not_import_numba():
    code = ("import sys; sys.path.insert(0, %r); import tileattn; "
            "print('numba' in sys.modules)" % str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "False"


_FORK_DURING_A_CALL = """
import faulthandler, os, sys, threading
sys.path.insert(0, {root!r})
import numpy as np
import tileattn
from tileattn import cpu

rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 8, 300, 64), dtype=np.float32) for _ in range(3))
expected = tileattn.forward(q, k, v, causal=True, backend="cpu")  # threads and pool started
decode_expected = tileattn.forward(q[:, :, :2], k, v, backend="cpu")
inside, release = threading.Event(), threading.Event()


def inside_a_call():  # what a thread inside a call holds at the fork
    with cpu._kernel_lock:
        inside.set()
        release.wait()


holder = threading.Thread(target=inside_a_call)
holder.start()
inside.wait()
pid = os.fork()
if pid == 0:
    faulthandler.dump_traceback_later(120, exit=True)  # a hang fails the test, with its stack
    same = (np.array_equal(tileattn.forward(q, k, v, causal=True, backend="cpu"), expected)
            and np.array_equal(tileattn.forward(q[:, :, :2], k, v, backend="cpu"),
                               decode_expected))
    os._exit(0 if same else 3)
release.set()
holder.join()
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_a_thread_is_inside_a_call_can_call():
    """A process forked while another of its threads is inside a CPU call (a fork-method
    multiprocessing pool beside a server's threads): the child's own calls return, with the
    parent's bits, instead of waiting forever on the lock the parent's thread held."""
    done = subprocess.run([sys.executable, "-c", _FORK_DURING_A_CALL.format(root=str(ROOT))],
                          capture_output=True, text=True, timeout=600, check=True)
    assert done.stdout.strip().splitlines()[-1] == "0", done.stderr[-2000:]


def test_small_problems_run_on_one_thread_and_large_ones_on_every_allowed_thread():
    import numba

    from tileattn.cpu import threads

    assert threads.threads_for(1e6) == 1
    assert threads.threads_for(threads.SECOND_THREAD_FLOPS - 1) == 1
    assert threads.threads_for(threads.SECOND_THREAD_FLOPS) == min(2, numba.get_num_threads())
    # beyond two, a thread per FLOPS_PER_THREAD: each one woken adds its start to the call
    assert threads.threads_for(2.5 * threads.FLOPS_PER_THREAD) == min(2, numba.get_num_threads())
    assert threads.threads_for(1e12) == numba.get_num_threads()
    previous = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        assert threads.threads_for(1e12) == 1  # numba.set_num_threads still limits tileattn
    finally:
        numba.set_num_threads(previous)


@pytest.mark.parametrize("n_q", [1, 96], ids=["decode", "tiled"])
def test_repeated_calls_reuse_their_plan_and_follow_the_thread_count(monkeypatch, n_q):
    """A repeated dense call takes the plan its first call made (the same validated options
    object, shapes and thread count), gives the same bits, and a call after
    numba.set_num_threads plans anew; other options never share a plan."""
    import numba

    from tileattn.cpu import threads

    q, k, v = _inputs((2, 4, n_q, 32), (2, 2, 300, 32), (2, 2, 300, 16), seed=n_q)
    cpu._FORWARD_PLANS.clear()
    first = tileattn.forward(q, k, v, causal=True, backend="cpu", return_lse=True)
    assert len(cpu._FORWARD_PLANS) == 1
    (plan,) = cpu._FORWARD_PLANS.values()
    assert (plan.decode is not None) == (n_q == 1)
    planned, original = [], cpu._forward_plan
    monkeypatch.setattr(cpu, "_forward_plan", lambda *a: planned.append(a) or original(*a))
    again = tileattn.forward(q, k, v, causal=True, backend="cpu", return_lse=True)
    assert not planned and len(cpu._FORWARD_PLANS) == 1
    for a, b in zip(first, again):
        assert np.array_equal(a, b)
    other = tileattn.forward(q, k, v, window=(50, 0), backend="cpu", return_lse=True)
    assert len(planned) == 1 and len(cpu._FORWARD_PLANS) == 2
    assert not np.array_equal(other[0], first[0])
    golden = _golden(q, k, v, window=(50, 0))
    assert_attention_close(other[0], golden[0], np.float32)
    previous = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        monkeypatch.setattr(threads, "FLOPS_PER_THREAD", 1.0)  # every call would want more
        tileattn.forward(q, k, v, causal=True, backend="cpu")
        assert len(planned) == 2
        assert all(p.n_workers == 1 for key, p in cpu._FORWARD_PLANS.items() if key[-1] == 1)
    finally:
        numba.set_num_threads(previous)


def test_allowed_threads_are_numbas_count_of_the_calling_thread():
    """`threads.allowed` (numba's C getter) answers what ``numba.get_num_threads()`` answers,
    after ``numba.set_num_threads`` and on another Python thread, whose count is its own."""
    import numba

    from tileattn.cpu import threads

    assert threads.allowed() == numba.get_num_threads()
    previous = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        assert threads.allowed() == 1
        seen = []
        other = threading.Thread(target=lambda: seen.append(
            (threads.allowed(), numba.get_num_threads())))
        other.start()
        other.join()
        assert seen[0][0] == seen[0][1] == numba.config.NUMBA_NUM_THREADS
    finally:
        numba.set_num_threads(previous)
    assert threads.allowed() == previous


def test_repeated_backwards_reuse_their_plan_and_follow_the_thread_count(monkeypatch):
    """As the forward's plans: a repeated dense backward takes its first call's plan and
    gives the same bits, other options plan anew, and after numba.set_num_threads(1) the
    call plans anew and runs on one thread, with gradients as close to the golden model."""
    import numba

    from tileattn.cpu import threads

    q, k, v = _inputs((1, 2, 200, 32), (1, 1, 200, 32), (1, 1, 200, 16), seed=5)
    o, lse = tileattn.forward(q, k, v, causal=True, backend="cpu", return_lse=True)
    do = np.random.default_rng(6).standard_normal(o.shape).astype(np.float32)
    cpu._BACKWARD_PLANS.clear()
    first = tileattn.backward(do, q, k, v, o, lse, causal=True, backend="cpu")
    assert len(cpu._BACKWARD_PLANS) == 1
    planned, original = [], cpu._backward_plan
    monkeypatch.setattr(cpu, "_backward_plan", lambda *a: planned.append(a) or original(*a))
    again = tileattn.backward(do, q, k, v, o, lse, causal=True, backend="cpu")
    assert not planned
    for a, b in zip(first, again):
        assert np.array_equal(a, b)
    tileattn.backward(do, q, k, v, o, lse, causal=True, softcap=5.0, backend="cpu")
    assert len(planned) == 1 and len(cpu._BACKWARD_PLANS) == 2
    runs = []
    monkeypatch.setattr(threads, "FLOPS_PER_THREAD", 1.0)  # every call would want more
    monkeypatch.setattr(threads, "run", lambda kernel, n, *a, run=threads.run: (
        runs.append(n), run(kernel, n, *a)))
    previous = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        one_thread = tileattn.backward(do, q, k, v, o, lse, causal=True, backend="cpu")
    finally:
        numba.set_num_threads(previous)
    new_plans = 2 if previous > 1 else 1  # one thread is then the first call's count
    assert len(planned) == new_plans and runs and set(runs) == {1}
    for name, grad, golden in zip(("dq", "dk", "dv"), one_thread,
                                  _golden_grads(do, q, k, v, o, causal=True)):
        assert_attention_close(grad, golden, np.float32, name=name)
    tileattn.backward(do, q, k, v, o, lse, causal=True, backend="cpu")
    assert len(planned) == new_plans  # the first call's thread count again: its plan


def test_cleared_plans_make_a_forced_policy_run(monkeypatch):
    """A plan is kept per signature, so a policy changed after the first call (a test
    forcing a schedule) is not seen by the next one of that signature until
    `backends.clear_plans` forgets the plans; tests/conftest.py does that around every test
    that monkeypatches."""
    from tileattn import backends
    from tileattn.cpu import backward_kernel

    q, k, v = _inputs((1, 2, 300, 32), (1, 2, 300, 32), (1, 2, 300, 32), seed=3)
    o, lse = tileattn.forward(q, k, v, causal=True, backend="cpu", return_lse=True)
    do = np.random.default_rng(4).standard_normal(o.shape).astype(np.float32)
    monkeypatch.setattr(cpu, "_use_heads_schedule", lambda *args: True)
    heads = tileattn.backward(do, q, k, v, o, lse, causal=True, backend="cpu")
    sums = []
    summed = backward_kernel.sum_key_parts
    monkeypatch.setattr(backward_kernel, "sum_key_parts",
                        lambda *args: (sums.append(1), summed(*args)))
    monkeypatch.setattr(cpu, "_use_heads_schedule", lambda *args: False)
    monkeypatch.setattr(cpu, "KEY_PARTS_BUDGET", 100.0)
    tileattn.backward(do, q, k, v, o, lse, causal=True, backend="cpu")
    assert not sums  # the heads schedule's plan ran again
    backends.clear_plans()
    assert not cpu._FORWARD_PLANS and not cpu._BACKWARD_PLANS
    key_parts = tileattn.backward(do, q, k, v, o, lse, causal=True, backend="cpu")
    assert sums  # planned anew: dQ in parts per key tile
    for name, grads in (("heads", heads), ("key parts", key_parts)):
        for grad, golden in zip(grads, _golden_grads(do, q, k, v, o, causal=True)):
            assert_attention_close(grad, golden, np.float32, name=name)


@pytest.mark.parametrize("n_q", [1, 96], ids=["decode", "tiled"])
def test_a_thread_with_its_own_thread_count_gets_its_own_plan(monkeypatch, n_q):
    """numba.set_num_threads holds for the Python thread that calls it: a call from a thread
    limited to one runs on one, while the same call from this thread keeps its threads."""
    import numba

    from tileattn.cpu import threads

    if numba.get_num_threads() < 2:
        pytest.skip("one thread here")
    q, k, v = _inputs((1, 4, n_q, 32), (1, 4, 500, 32), (1, 4, 500, 32), seed=7)
    monkeypatch.setattr(threads, "FLOPS_PER_THREAD", 1.0)  # every call would want more
    runs = []
    monkeypatch.setattr(threads, "run", lambda kernel, n, *a, run=threads.run: (
        runs.append((threading.get_ident(), n)), run(kernel, n, *a)))
    expected = tileattn.forward(q, k, v, backend="cpu")
    results = []

    def limited():
        numba.set_num_threads(1)
        results.append(tileattn.forward(q, k, v, backend="cpu"))

    worker = threading.Thread(target=limited)
    worker.start()
    worker.join()
    tileattn.forward(q, k, v, backend="cpu")
    assert [n for ident, n in runs if ident == worker.ident] == [1]
    assert all(n > 1 for ident, n in runs if ident != worker.ident)
    assert_attention_close(results[0], _golden(q, k, v)[0], np.float32)
    assert_attention_close(expected, _golden(q, k, v)[0], np.float32)


def _strided(array, rng):
    """`array`'s values in an array of the same shape and dtype with other strides: every
    second row of a taller one, its last two axes stored transposed."""
    taller = rng.standard_normal(array.shape[:-2] + (array.shape[-1], 2 * array.shape[-2]))
    view = taller.astype(array.dtype).swapaxes(-1, -2)[..., ::2, :]
    view[...] = array
    return view


@pytest.mark.parametrize("n_q", [1, 96], ids=["decode", "tiled"])
def test_same_shapes_with_other_strides_or_byte_order_give_the_same_bits(n_q):
    """The remembered problem and the kernels' plans are kept per shape, dtype and options:
    a call of the same shapes whose arrays have other strides, another byte order or are
    read-only gives the bits of the contiguous native call, leaves its inputs as they were,
    and returns arrays that share no memory with them."""
    rng = np.random.default_rng(n_q)
    q, k, v = _inputs((2, 4, n_q, 32), (2, 2, 150, 32), (2, 2, 150, 16), seed=n_q)
    o, lse = tileattn.forward(q, k, v, causal=True, backend="cpu", return_lse=True)
    do = rng.standard_normal(o.shape).astype(np.float32)
    grads = tileattn.backward(do, q, k, v, o, lse, causal=True, backend="cpu")
    swapped = [a.astype(a.dtype.newbyteorder()) for a in (q, k, v, do, o, lse)]
    read_only = [a.copy() for a in (q, k, v, do, o, lse)]
    for a in read_only:
        a.flags.writeable = False
    for arrays in ([_strided(a, rng) for a in (q, k, v, do, o)] + [lse], swapped, read_only):
        kept = [a.copy() for a in arrays]
        for _ in range(2):  # the second call is a remembered signature, where remembered
            o_again, lse_again = tileattn.forward(*arrays[:3], causal=True, backend="cpu",
                                                  return_lse=True)
            grads_again = tileattn.backward(*arrays[3:4], *arrays[:3], *arrays[4:],
                                            causal=True, backend="cpu")
            for result, expected in zip((o_again, lse_again, *grads_again), (o, lse, *grads)):
                assert result.dtype == expected.dtype and result.dtype.isnative
                assert result.tobytes() == expected.tobytes()
                assert not any(np.shares_memory(result, a) for a in arrays)
        for a, before in zip(arrays, kept):
            assert a.tobytes() == before.tobytes()


def test_the_cpu_caches_keep_no_array_alive():
    import gc
    import weakref

    q, k, v = _inputs((1, 2, 1, 16), (1, 2, 40, 16), (1, 2, 40, 16), seed=8)
    for _ in range(2):
        o, lse = tileattn.forward(q, k, v, backend="cpu", return_lse=True)
        grads = tileattn.backward(o, q, k, v, o, lse, backend="cpu")
    references = [weakref.ref(a) for a in (q, k, v, o, lse, *grads)]
    del q, k, v, o, lse, grads
    gc.collect()
    assert all(reference() is None for reference in references)


def test_run_gives_every_task_to_exactly_one_thread_and_reraises_errors():
    from tileattn.cpu import threads

    def claim(next_task):
        with lock:
            task = int(next_task[0])
            next_task[0] += 1
        return task

    lock = threading.Lock()
    done = []

    def kernel(n_tasks, next_task):
        task = claim(next_task)
        while task < n_tasks:
            done.append(task)
            task = claim(next_task)

    threads.run(kernel, 4, 50)
    assert sorted(done) == list(range(50))

    def failing(next_task):
        raise ValueError("from a kernel")

    with pytest.raises(ValueError, match="from a kernel"):
        threads.run(failing, 2)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux thread affinity and two cores")
def test_pool_threads_start_away_from_the_caller_and_get_its_core_back():
    """A call's pool thread is woken on the caller's cores but the caller's own (so Linux
    cannot queue it behind the caller), and once the caller's share is done it may use
    that core too; a caller restricted to some cores keeps the pool within them."""
    from tileattn.cpu import threads

    cores = sorted(os.sched_getaffinity(0))
    seen = []
    started = threading.Event()
    main = threading.get_ident()

    def kernel(next_task):
        if threading.get_ident() == main:  # the caller's copy waits for the pool's to start
            started.wait(5)
            return
        seen.append(os.sched_getaffinity(0))
        started.set()
        time.sleep(0.05)  # the caller's copy returns meanwhile
        seen.append(os.sched_getaffinity(0))

    threads.run(kernel, 2)  # starts (and registers) a pool thread
    for allowed in ({cores[0], cores[1]}, set(cores)):
        os.sched_setaffinity(0, allowed)
        try:
            seen.clear()
            started.clear()
            threads.run(kernel, 2)
        finally:
            os.sched_setaffinity(0, cores)
        at_start, later = seen
        assert at_start < allowed, (at_start, allowed)
        assert later == allowed


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux thread affinity and two cores")
def test_calls_wider_than_the_placed_ones_leave_pool_threads_on_every_core(monkeypatch):
    """Above PLACED_MAX_THREADS a call does not move its pool threads off the caller's
    core, and a pool thread that a narrower call had moved may use every core again."""
    from tileattn.cpu import threads

    cores = set(os.sched_getaffinity(0))
    seen = []
    main = threading.get_ident()

    def kernel(next_task):
        if threading.get_ident() != main:
            seen.append(os.sched_getaffinity(0))
            return
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:  # the pool thread's copy ran
            time.sleep(0.001)

    threads.run(kernel, 2)  # placed: the pool thread starts away from the caller's core
    assert seen and seen[-1] < cores
    assert threads._helpers.away() == cores  # as a narrow call leaves them when it ends first
    seen.clear()
    monkeypatch.setattr(threads, "PLACED_MAX_THREADS", 1)
    threads.run(kernel, 2)
    assert seen == [cores]


def test_run_gives_every_task_once_over_many_calls_and_callers():
    """Compiled kernels back to back, and from four Python threads at once."""
    import numba
    from numba import njit

    from tileattn.cpu import threads
    from tileattn.cpu.schedule import claim_next

    @njit(nogil=True)
    def kernel(counts, next_task):
        task = claim_next(next_task)
        while task < counts.size:
            counts[task] += 1
            for _ in range(200):  # a little work, so that helpers join
                counts[task] += 0
            task = claim_next(next_task)

    n_threads = max(2, numba.get_num_threads())
    failures = []

    def calls(n_calls):
        for _ in range(n_calls):
            counts = np.zeros(257, np.int64)
            threads.run(kernel, n_threads, counts)
            if not (counts == 1).all():
                failures.append(counts)

    calls(300)
    callers = [threading.Thread(target=calls, args=(100,)) for _ in range(4)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert not failures


# --------------------------------------------------------------------------- block sizes


def test_default_blocks_are_powers_of_two_within_the_key_tile_budget():
    for head_dim in (16, 64, 128, 256):
        for itemsize in (4, 8):
            for kind, masked in (("forward", True), ("forward", False), ("backward", True)):
                blocks = cpu_blocks.default_blocks(kind, head_dim, head_dim, itemsize, masked)
                for size in (blocks.block_q, blocks.block_k):
                    assert 32 <= size <= 1024 and size & (size - 1) == 0
                # the K and V rows of a key tile fit the budget, and twice the keys would not
                tile_bytes = blocks.block_k * 2 * head_dim * itemsize
                assert tile_bytes <= cpu_blocks.KEY_TILE_BYTES or blocks.block_k == 32
                assert 2 * tile_bytes > cpu_blocks.KEY_TILE_BYTES or blocks.block_k == 512
    # the machine's caches do not move the tiles: D = 256 float32 gets full-size tiles
    assert cpu_blocks.default_blocks("backward", 256, 256, 4) == Blocks(256, 512)
    forward = cpu_blocks.default_blocks("forward", 64, 64, 4)
    backward = cpu_blocks.default_blocks("backward", 64, 64, 4)
    assert backward.block_q <= forward.block_q
    # without a mask the forward takes taller query tiles (no cut diagonal to slice)
    assert cpu_blocks.default_blocks("forward", 64, 64, 4, masked=False).block_q >= forward.block_q


def test_cache_sizes_parse_sysfs_and_fall_back(monkeypatch, tmp_path):
    index = tmp_path / "index2"
    index.mkdir()
    (index / "level").write_text("2\n")
    (index / "type").write_text("Unified\n")
    (index / "size").write_text("1024K\n")
    monkeypatch.setattr(cpu_blocks, "_SYSFS_CACHES", str(tmp_path / "index*"))
    cpu_blocks.cache_sizes.cache_clear()
    try:
        sizes = cpu_blocks.cache_sizes()
        assert sizes.l2 == 1024 * 1024
        assert sizes.l1d == cpu_blocks.FALLBACK_CACHES.l1d
        monkeypatch.setattr(cpu_blocks, "_SYSFS_CACHES", str(tmp_path / "missing*"))
        cpu_blocks.cache_sizes.cache_clear()
        assert cpu_blocks.cache_sizes() == cpu_blocks.FALLBACK_CACHES
    finally:
        cpu_blocks.cache_sizes.cache_clear()
    assert cpu_blocks._parse_size("8M") == 8 * 1024**2


def test_query_tiles_shrink_until_every_thread_has_work():
    def tasks(size):
        return 1 * 1 * -(-1024 // size)

    assert cpu_blocks.spread_over_threads(512, tasks, 2) == 128
    assert cpu_blocks.spread_over_threads(512, tasks, 64) == 64
    assert cpu_blocks.spread_over_threads(512, lambda size: 100, 2) == 512


@pytest.mark.parametrize("n_q, n_k, window_left, window_right, band_offset",
                         [(1000, 1000, -1, 0, None), (700, 1000, -1, 0, None),
                          (1000, 600, 100, 30, None), (512, 512, -1, -1, None),
                          (600, 1000, 700, 0, 900), (600, 1000, -1, 0, -300)])
def test_tasks_run_longest_first(n_q, n_k, window_left, window_right, band_offset):
    """The order `tile_order.longest_first` deals tiles in, for query and for key tiles,
    against kept pairs counted from `tileattn.options.keeps`; a `band_offset` other than
    ``n_k - n_q`` is a block placed in a longer sequence."""
    from tileattn.tile_order import longest_first
    from tileattn.options import keeps

    if band_offset is None:
        band_offset = n_k - n_q
    kept = keeps(np.arange(n_q)[:, None], np.arange(n_k)[None, :], band_offset, window_left,
                 window_right)
    block = 128
    for along_keys in (False, True):
        pairs = kept.T if along_keys else kept
        n_tiles = -(-pairs.shape[0] // block)
        cost = [pairs[t * block:(t + 1) * block].sum() for t in range(n_tiles)]
        if along_keys:
            order = longest_first(n_tiles, block, n_k, n_q, -band_offset, window_right,
                                  window_left)
        else:
            order = longest_first(n_tiles, block, n_q, n_k, band_offset, window_left,
                                  window_right)
        assert sorted(order) == list(range(n_tiles))
        costs = [cost[t] for t in order]
        assert costs == sorted(costs, reverse=True)


# --------------------------------------------------------------------------- layouts, dtypes


def test_non_contiguous_and_negative_stride_inputs():
    q, k, v = _inputs((3, 2, 40, 16), (3, 2, 60, 16), (3, 2, 60, 16))
    do = np.random.default_rng(5).standard_normal((2, 3, 40, 16)).astype(np.float32)
    views = (
        np.swapaxes(q.copy(order="F"), 0, 1)[:, :, ::-1],  # transposed, reversed rows
        np.swapaxes(k, 0, 1)[..., ::-1],  # reversed head dim
        np.ascontiguousarray(np.swapaxes(v, 0, 1)[:, :, ::-1])[:, :, ::-1],
    )
    q_view, k_view, v_view = views
    assert not any(a.flags.c_contiguous for a in (q_view, k_view))
    before = [a.copy() for a in (q_view, k_view, v_view, do)]
    o, lse = tileattn.forward(q_view, k_view, v_view, causal=True, backend="cpu",
                              return_lse=True)
    expected_o, expected_lse = _golden(q_view, k_view, v_view, causal=True)
    assert_attention_close(o, expected_o, np.float32, name="o")
    assert_attention_close(lse, expected_lse, np.float32, name="lse")
    do_view = do[:, :, ::-1][:, :, ::-1]
    grads = tileattn.backward(do_view, q_view, k_view, v_view, o[:, :, ::-1][:, :, ::-1],
                              lse, causal=True, backend="cpu")
    for name, grad, golden in zip(("dq", "dk", "dv"), grads,
                                  _golden_grads(do_view, q_view, k_view, v_view, o,
                                                causal=True)):
        assert_attention_close(grad, golden, np.float32, name=name)
    for original, after in zip(before, (q_view, k_view, v_view, do)):
        np.testing.assert_array_equal(original, after)


def test_contiguous_inputs_of_the_compute_dtype_are_not_copied():
    q = np.zeros((1, 2, 8, 4), np.float32)
    assert np.shares_memory(cpu._read_only(q, np.dtype(np.float32)), q)
    assert q.flags.writeable  # the read-only flag is on a view, not the caller's array
    assert not np.shares_memory(cpu._read_only(q[:, :, ::2], np.dtype(np.float32)), q)


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_half_precision_inputs(dtype):
    dtype = bfloat16() if dtype == "bfloat16" else np.dtype(dtype)
    if dtype is None:
        pytest.skip("ml_dtypes is not installed")
    q, k, v = _inputs((2, 4, 90, 32), (2, 2, 110, 32), (2, 2, 110, 16), dtype=dtype)
    do = np.random.default_rng(3).standard_normal((2, 4, 90, 16)).astype(dtype)
    options = {"causal": True, "softcap": 5.0}
    o, lse = tileattn.forward(q, k, v, backend="cpu", return_lse=True, **options)
    assert o.dtype == dtype and lse.dtype == np.float32
    expected_o, expected_lse = _golden(q, k, v, **options)
    assert_attention_close(o, expected_o, dtype, name="o")
    assert_attention_close(lse, expected_lse, dtype, name="lse")
    grads = tileattn.backward(do, q, k, v, o, lse, backend="cpu", **options)
    for name, grad, like, golden in zip(("dq", "dk", "dv"), grads, (q, k, v),
                                        _golden_grads(do, q, k, v, o, **options)):
        assert grad.dtype == dtype and grad.shape == like.shape
        assert_attention_close(grad, golden, dtype, name=name)


# --------------------------------------------------------------------------- kernel pieces


def test_both_backward_schedules_agree_with_the_golden_model_and_are_deterministic():
    # B * Hkv = 1 takes the split (key tiles, then query tiles) schedule on two or more
    # threads, B * Hkv = 8 the one-task-per-head schedule.
    for shape_kv in ((1, 1, 300, 32), (2, 4, 300, 32)):
        q, k, v = _inputs((shape_kv[0], 8, 280, 32), shape_kv, shape_kv, seed=7)
        do = np.random.default_rng(8).standard_normal(q.shape).astype(np.float32)
        options = {"window": (100, 20), "block_q": 64, "block_k": 96}
        o, lse = tileattn.forward(q, k, v, backend="cpu", return_lse=True, **options)
        first = tileattn.backward(do, q, k, v, o, lse, backend="cpu", **options)
        second = tileattn.backward(do, q, k, v, o, lse, backend="cpu", **options)
        for a, b in zip(first, second):
            np.testing.assert_array_equal(a, b)
        for name, grad, golden in zip(("dq", "dk", "dv"), first,
                                      _golden_grads(do, q, k, v, o, **options)):
            assert_attention_close(grad, golden, np.float32, name=name)


@pytest.mark.parametrize("options", [{"causal": True}, {"window": (60, 5), "softcap": 4.0},
                                     {"dropout_p": 0.25, "seed": 3, "alibi_slopes": "each"},
                                     {"causal": True, "nan_key": 150}],
                         ids=["causal", "window-softcap", "dropout-alibi", "causal-nan-key"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_every_backward_schedule_gives_the_same_bits(monkeypatch, options, packed):
    """One task per kv head, dQ in parts per key tile summed in key-tile order, and the
    split schedule (dQ over query tiles) add every term in the same order: bitwise equal
    gradients for the same tiles, GQA and packed sequences included, and the golden
    model's; a NaN in K at a key that the causal mask hides from the rows before it
    reaches only the rows that keep it (and dK, dV of that key), in every schedule."""
    from tileattn import cpu

    q, k, v = _inputs((1, 4, 300, 32), (1, 2, 300, 32), (1, 2, 300, 40), seed=11)
    do = np.random.default_rng(12).standard_normal((1, 4, 300, 40)).astype(np.float32)
    options = dict(options)
    nan_key = options.pop("nan_key", None)
    if nan_key is not None:
        k[0, 0, nan_key, 3] = np.nan
    options = dict(options, block_q=64, block_k=96)
    if options.get("alibi_slopes") == "each":
        options["alibi_slopes"] = np.linspace(0.1, 0.5, 4)
    if packed:  # (H, N_total, D): sequences of 70, 1 and 229 rows
        q, k, v, do = (a[0] for a in (q, k, v, do))
        options["cu_seqlens_q"] = options["cu_seqlens_k"] = np.array([0, 70, 71, 300])
    o, lse = tileattn.forward(q, k, v, backend="cpu", return_lse=True, **options)
    from tileattn.cpu import backward_kernel

    sums = []
    summed = backward_kernel.sum_key_parts
    monkeypatch.setattr(backward_kernel, "sum_key_parts",
                        lambda *args: (sums.append(1), summed(*args)))
    results = {}
    for name, heads, budget in (("heads", True, 0.0), ("key-parts", False, 100.0),
                                ("split", False, 0.0)):
        monkeypatch.setattr(cpu, "_use_heads_schedule", lambda *args, use=heads: use)
        monkeypatch.setattr(cpu, "KEY_PARTS_BUDGET", budget)
        cpu._BACKWARD_PLANS.clear()  # else the call would take the first schedule's plan
        sums.clear()
        results[name] = tileattn.backward(do, q, k, v, o, lse, backend="cpu", **options)
        assert bool(sums) == (name == "key-parts")  # once a thread that ran it
    for name in ("key-parts", "split"):
        for a, b in zip(results["heads"], results[name]):
            np.testing.assert_array_equal(a, b)
    golden = tileattn.backward(*(a.astype(np.float64) for a in (do, q, k, v, o)), lse,
                               backend="reference", **options)
    for name, grad, want in zip(("dq", "dk", "dv"), results["key-parts"], golden):
        assert_attention_close(grad, want, np.float32, name=name)
    if nan_key is not None:
        # Query heads 0 and 1 read kv head 0; packed, the key is the third sequence's 80th
        # (it starts at row 71), so the same rows keep it.
        heads = results["key-parts"][0].reshape(4, 300, 32)
        assert np.isfinite(heads[:2, :nan_key]).all() and np.isnan(heads[:2, nan_key:]).all()
        assert np.isfinite(heads[2:]).all()


def test_exp2_matches_numpy_over_its_domain():
    from numba import njit

    from tileattn.cpu.vector_math import FASTMATH, exp2_nonpositive

    @njit(fastmath=FASTMATH)
    def evaluate(x):
        out = np.empty_like(x)
        for i in range(x.size):
            out[i] = exp2_nonpositive(x[i])
        return out

    x = np.concatenate([np.linspace(-130, 0, 20001), [-np.inf, np.nan, -0.0, -126.0]])
    x = x.astype(np.float32)
    result = evaluate(x)
    expected = np.exp2(x.astype(np.float64))
    normal = expected >= 2.0**-126
    # 1.6 ulp of float32 measured; 2 allowed
    assert np.max(np.abs(result[normal] / expected[normal] - 1)) < 2 * 2.0**-23
    assert np.all(result[~normal & ~np.isnan(x)] <= 2.0**-126)
    assert result[x == -np.inf][0] == 0
    assert np.isnan(result[np.isnan(x)]).all()


def test_dropout_hash_is_bit_identical_to_the_reference():
    from numba import njit

    from tileattn.cpu import dropout as cpu_dropout

    @njit
    def kernel_mask(key, threshold, bh, rows, cols):
        out = np.empty((rows.size, cols.size), np.bool_)
        for r in range(rows.size):
            state = cpu_dropout.row_state(key, bh, rows[r])
            for c in range(cols.size):
                out[r, c] = cpu_dropout.keeps(state, cols[c], threshold)
        return out

    rng = np.random.default_rng(11)
    rows = np.concatenate([np.arange(40), [2**31 - 1, 2**32 - 1]]).astype(np.int64)
    cols = np.concatenate([np.arange(50), [2**31, 2**32 - 2]]).astype(np.int64)
    for seed in (0, 1, 2**32 - 1, 2**32, 2**63 + 12345, 2**64 - 1,
                 int(rng.integers(0, 2**63))):
        for p in (0.1, 0.5, 0.97):
            for bh in (0, 5, 2**32 - 1):
                expected = keep_mask(seed, p, bh, rows[:, None], cols[None, :])
                actual = kernel_mask(dropout_key(seed), dropout_threshold(p), bh, rows, cols)
                np.testing.assert_array_equal(actual, expected)


def test_nan_at_masked_positions_does_not_leak():
    q, k, v = _inputs((1, 2, 70, 16), (1, 2, 70, 16), (1, 2, 70, 16))
    k = k.copy()
    k[:, :, 60:] = np.nan  # only rows >= 60 keep these keys under a causal mask
    o, lse = tileattn.forward(q, k, v, causal=True, backend="cpu", return_lse=True,
                              block_q=16, block_k=16)
    assert np.isfinite(o[:, :, :60]).all() and np.isfinite(lse[:, :, :60]).all()
    assert np.isnan(o[:, :, 60:]).all()


def test_options_reach_the_kernels_as_scalars():
    """Compiling once per dtype: two calls with different options add no signature."""
    from tileattn.cpu.forward_kernel import forward_kernel

    q, k, v = _inputs((1, 2, 30, 8), (1, 2, 30, 8), (1, 2, 30, 8))
    tileattn.forward(q, k, v, backend="cpu")
    count = len(forward_kernel.signatures)
    tileattn.forward(q, k, v, causal=True, softcap=3.0, dropout_p=0.1, seed=3, scale=0.5,
                     alibi_slopes=np.array([0.1, 0.2]), window=(5, None), backend="cpu")
    assert len(forward_kernel.signatures) == count


def test_reference_options_object_directly():
    """The backend contract: 4-D arrays and an AttentionOptions, results in input dtypes."""
    q, k, v = _inputs((1, 4, 33, 8), (1, 2, 47, 8), (1, 2, 47, 12), dtype=np.float64)
    options = AttentionOptions(window_left=7, window_right=0, causal=True, scale=0.3,
                               alibi_slopes=np.array([[0.5, 0.25, 0.125, 0.0625]]))
    o, lse = cpu.forward(q, k, v, options)
    assert o.dtype == np.float64 and lse.dtype == np.float64
    expected_o, expected_lse = reference.dense_forward(q, k, v, options)
    assert_attention_close(o, expected_o, np.float64, name="o")
    assert_attention_close(lse, expected_lse, np.float64, name="lse")


def _in_a_new_thread(function):
    """`function()` run on a new thread; its result, or its exception raised here."""
    outcome = {}

    def run():
        try:
            outcome["result"] = function()
        except BaseException as error:  # noqa: BLE001 (re-raised on the caller's thread)
            outcome["error"] = error
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


@pytest.mark.parametrize("on_new_thread", [False, True], ids=["main-thread", "new-thread"])
def test_scipy_blas_is_single_threaded_inside_and_restored_after(on_new_thread):
    """The kernels' np.dot runs SciPy's BLAS on one thread (cpu/blas.py); each library gets
    back the thread count it had, whether that was one or more; also for a call from a
    thread other than the one that first set the count (threadpoolctl ignores those)."""
    from tileattn.cpu import blas

    libraries = blas._libraries()
    if not libraries:
        pytest.skip("threadpoolctl or a SciPy BLAS it controls is not installed")
    counts = lambda: [library.get_num_threads() for library, _ in libraries]  # noqa: E731
    before = counts()

    def check():
        for start in (2, 1):
            for _, set_num_threads in libraries:
                set_num_threads(start)
            with blas.single_threaded():
                assert counts() == [1] * len(libraries)
            assert counts() == [start] * len(libraries)
    try:
        _in_a_new_thread(check) if on_new_thread else check()
    finally:
        for (_, set_num_threads), threads in zip(libraries, before):
            set_num_threads(threads)


def test_a_call_from_another_thread_gives_the_same_bits():
    """The same call on the main thread and on a new one (a server's worker) returns the
    same bits: both run SciPy's BLAS on one thread, whose sgemm sums in another order than
    its threaded driver (threadpoolctl's own setter ignores calls from other threads)."""
    rng = np.random.default_rng(11)
    q, do = (rng.standard_normal((1, 4, 200, 64)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, 2, 250, 64)).astype(np.float32) for _ in range(2))

    def call():
        o, lse = tileattn.forward(q, k, v, backend="cpu", return_lse=True, causal=True)
        return (o, lse) + tuple(tileattn.backward(do, q, k, v, o, lse, backend="cpu",
                                                  causal=True))
    on_main = call()
    for name, main, other in zip(("o", "lse", "dq", "dk", "dv"), on_main,
                                 _in_a_new_thread(call)):
        assert np.array_equal(main, other), name


def test_decode_limits_blas_only_where_its_products_call_it(monkeypatch):
    """Up to MAX_LOOP_ROWS packed rows the decode kernel's products are plain loops: its
    call skips the BLAS thread limit (a few microseconds a step); more rows call BLAS and
    hold it at one thread. Both give the golden model's results."""
    from tileattn.cpu import blas
    from tileattn.cpu.decode_kernel import MAX_LOOP_ROWS

    limited = []
    real = blas.single_threaded

    def counting():
        limited.append(True)
        return real()

    monkeypatch.setattr(blas, "single_threaded", counting)
    rng = np.random.default_rng(3)
    loop_rows = MAX_LOOP_ROWS // 8  # a group of 8 query heads over one kv head
    for n_q_heads, n_q, expect_limit in ((8, loop_rows, False), (8, loop_rows + 1, True)):
        q = rng.standard_normal((1, n_q_heads, n_q, 32))
        k, v = (rng.standard_normal((1, 1, 600, 32)) for _ in range(2))
        limited.clear()
        o = tileattn.forward(q, k, v, backend="cpu", causal=True)
        assert bool(limited) == expect_limit
        expected = tileattn.forward(q, k, v, backend="reference", causal=True)
        assert_attention_close(o, expected, np.float64, name="o")


def _subnormals_work_here() -> bool:
    tiny = np.array([1e-38], np.float32)
    return bool((tiny * np.float32(0.01))[0] != 0) and bool((tiny / np.float32(2))[0] != 0)


@pytest.mark.parametrize("n_q", [1, 64])  # the decode kernel and the forward kernel
def test_kernels_flush_subnormals_but_leave_the_callers_arithmetic_ieee(n_q):
    """The kernels flush subnormals (`tileattn.cpu.denormals`: ALiBi's tiny probabilities
    made x86 cores take microcode assists) and put the thread's MXCSR back: NumPy on the
    calling thread still makes subnormals afterwards. Steep ALiBi slopes give
    probabilities below float32's smallest normal number; the result stays exact."""
    assert _subnormals_work_here()
    q, k, v = _inputs((1, 4, n_q, 32), (1, 4, 600, 32), (1, 4, 600, 32), seed=3)
    slopes = np.full(4, 2.0, np.float32)
    o, lse = tileattn.forward(q, k, v, alibi_slopes=slopes, causal=True, return_lse=True,
                              backend="cpu")
    assert _subnormals_work_here()
    expected_o, expected_lse = _golden(q, k, v, alibi_slopes=slopes, causal=True)
    assert_attention_close(o, expected_o, np.float32, name="o")
    assert_attention_close(lse, expected_lse, np.float32, name="lse")
    tileattn.backward(np.ones_like(o), q, k, v, o, lse, alibi_slopes=slopes, causal=True,
                      backend="cpu")
    assert _subnormals_work_here()
