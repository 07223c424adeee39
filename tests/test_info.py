"""``python -m tileattn info`` (`tileattn.info.describe`) reports what the dispatch of each
backend chooses for the shape: the CPU's plans (`_forward_plan`, `_backward_plan`), the GPU's
`launch_forward.choose`, fold and backward decisions. The GPU's lines are checked without a
GPU: the tile choices on `tiles.Problem` values here, and the backend's describe on a CuPy
stand-in with a device profile (its own process: the stand-in goes into sys.modules)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from tileattn import info
from tileattn.gpu import tiles
from tileattn.gpu.tiles import DecodeShape, Problem
from tileattn.traffic import memory_traffic

H200 = dict(capability=90, shared_limit=232448)
A100 = dict(capability=80, shared_limit=163 * 1024)


def report(**shape) -> list[str]:
    lines = []
    info.describe(print_fn=lines.append, **shape)
    return lines


def section(lines: list[str], backend: str) -> list[str]:
    start = next(i for i, line in enumerate(lines) if line.startswith(f"[{backend}]"))
    end = next(i for i in range(start, len(lines)) if lines[i] == "")
    return lines[start:end]


def line_of(lines: list[str], prefix: str) -> str:
    return next(line.strip() for line in lines if line.strip().startswith(prefix))


# --------------------------------------------------------------------------- the arguments


@pytest.mark.parametrize("keywords, error, message", [
    ({"kv_heads": 0}, ValueError, "kv_heads must be >= 1, got 0"),
    ({"n_k": 0}, ValueError, "n_k must be >= 1, got 0"),
    ({"seq_len": 0}, ValueError, "seq_len must be >= 1, got 0"),
    ({"head_dim": 0}, ValueError, "head_dim must be >= 1, got 0"),
    ({"value_dim": 0}, ValueError, "value_dim must be >= 1, got 0"),
    ({"batch": 0}, ValueError, "batch must be >= 1, got 0"),
    ({"heads": 0}, ValueError, "heads must be >= 1, got 0"),
    ({"heads": 8, "kv_heads": 3}, ValueError,
     "heads must be a multiple of kv_heads, got heads=8, kv_heads=3"),
    ({"causal": "no"}, TypeError, "causal must be a bool, got 'no'"),
    ({"seq_len": 1.5}, TypeError, "seq_len must be an int, got 1.5"),
    ({"heads": True}, TypeError, "heads must be an int, got True"),
    ({"dtype": "int32"}, ValueError, "dtype must be one of float16, bfloat16, float32, "
                                     "float64, got 'int32'"),
    ({"dtype": "nonsense"}, TypeError, "dtype must be one of"),
])
def test_bad_arguments_are_named(keywords, error, message):
    """They raised ZeroDivisionError, printed nonsense, or took "no" for causal."""
    with pytest.raises(error) as raised:
        report(**{"seq_len": 64, **keywords})
    assert message in str(raised.value)


def test_bfloat16_by_name_as_the_command_line_takes_it():
    pytest.importorskip("ml_dtypes")
    lines = report(seq_len=64, dtype="bfloat16")  # raised TypeError from np.dtype
    assert "bfloat16, causal=True" in lines[0]


# --------------------------------------------------------------------------- the CPU


@pytest.fixture
def two_threads(monkeypatch):
    """The CPU plans as on a two-core machine, whatever this one has."""
    from tileattn.cpu import threads

    monkeypatch.setattr(threads, "allowed", lambda: 2)


def cpu_plans(batch, heads, kv_heads, n_q, n_k, head_dim, dtype=np.float32, causal=True):
    """The plans the CPU backend makes for real arrays of this shape (the oracle)."""
    from tileattn import cpu
    from tileattn.validation import validate

    arrays = [np.zeros((batch, h, n, head_dim), dtype)
              for h, n in ((heads, n_q), (kv_heads, n_k), (kv_heads, n_k))]
    options = validate(*arrays, causal=causal, window=None, scale=None, softcap=None,
                       alibi_slopes=None, dropout_p=0.0, seed=None, block_q=None,
                       block_k=None, deterministic=True).options
    q, k, v = (np.ascontiguousarray(a) for a in arrays)
    do = np.zeros_like(q)
    return (cpu._forward_plan(q, k, v, options, cpu.Sequences(q, k, options)),
            cpu._backward_plan(q, k, v, do, options, cpu.Sequences(q, k, options)))


@pytest.mark.parametrize("causal", [True, False])
def test_cpu_tiles_are_the_plans(two_threads, causal):
    """Causal N=4096 printed the unmasked forward's 1024 x 512 where the plan takes 512 x
    512; the thread spreading of small grids was not applied either."""
    for batch, heads, n in ((1, 8, 4096), (1, 1, 512)):
        forward, backward = cpu_plans(batch, heads, heads, n, n, 64, causal=causal)
        lines = section(report(seq_len=n, heads=heads, causal=causal), "cpu")
        block_q, block_k, _ = backward.tiling
        assert line_of(lines, "tiles for this shape") == (
            f"tiles for this shape: forward block_q={forward.blocks.block_q} "
            f"block_k={forward.blocks.block_k}, backward block_q={block_q} block_k={block_k}")
    assert "forward block_q=512 block_k=512" in line_of(
        section(report(), "cpu"), "tiles for this shape")


def test_cpu_backward_names_the_schedule_its_plan_runs(two_threads):
    from tileattn.cpu.backward_kernel import HEADS, KEY_PARTS, KEY_TILES

    cases = {  # (batch, Hq, Hkv, Nq, Nk, D): the schedule
        (1, 8, 8, 512, 512, 64): HEADS,
        (1, 1, 1, 1024, 1024, 64): KEY_PARTS,
        (1, 8, 1, 9379, 1024, 225): KEY_TILES,
    }
    for (batch, heads, kv_heads, n_q, n_k, head_dim), schedule in cases.items():
        _, plan = cpu_plans(batch, heads, kv_heads, n_q, n_k, head_dim)
        assert plan.runs[0][0] == schedule
        line = line_of(section(report(seq_len=n_q, n_k=n_k, heads=heads, kv_heads=kv_heads,
                                      head_dim=head_dim, batch=batch), "cpu"),
                       "backward kernel")
        expected = {HEADS: "a task per (batch element, kv head)",
                    KEY_PARTS: f"dQ summed from a part per key tile ({plan.n_parts} parts)",
                    KEY_TILES: "then one per query tile (dQ)"}[schedule]
        assert expected in line, line
        assert "per key tile" not in line if schedule == HEADS else True


def test_cpu_decode_line_counts_its_splits(two_threads):
    from tileattn.cpu import decode

    one = line_of(section(report(seq_len=1, n_k=64, heads=1), "cpu"), "forward kernel")
    assert "one key split" in one and "merged" not in one
    forward, _ = cpu_plans(1, 8, 1, 1, 65536, 64)
    assert forward.decode is not None and forward.decode.n_splits > 1
    many = line_of(section(report(seq_len=1, n_k=65536, heads=8, kv_heads=1), "cpu"),
                   "forward kernel")
    assert f"{forward.decode.n_splits} key splits" in many and "log-sum-exp" in many
    assert decode.takes(1, 65536, 8)


def test_describing_a_large_batch_builds_no_task_list(two_threads):
    """The plans keep a task list per (batch element, tile): info counts them instead."""
    start = time.perf_counter()
    lines = section(report(seq_len=2 ** 20, heads=8, batch=2 ** 16, causal=False), "cpu")
    assert time.perf_counter() - start < 60
    assert line_of(lines, "tiles for this shape").startswith("tiles for this shape: forward")


def test_traffic_reads_the_value_dim(two_threads):
    """--value-dim changed nothing in the traffic model."""
    from tileattn import cpu

    for value_dim in (16, 256):
        lines = section(report(seq_len=1024, value_dim=value_dim), "cpu")
        blocks = cpu.tile_sizes(1024, 1024, 64, value_dim, np.float32, 8,
                                info.AttentionOptions(causal=True, window_right=0))
        traffic = memory_traffic(n_q=1024, n_k=1024, head_dim=64, value_dim=value_dim,
                                 heads=8, itemsize=4, block_q=blocks["forward"].block_q,
                                 block_k=blocks["forward"].block_k, causal=True)
        assert info._megabytes(traffic.tiled_forward) in line_of(lines, "forward :")


# --------------------------------------------------------------------------- GPU tile choices


def shape_of(n_q, n_k, heads, kv_heads, batch=1, sm_count=132):
    return DecodeShape(n_q=n_q, group=heads // kv_heads, batch_kv_heads=batch * kv_heads,
                       batch_q_heads=batch * heads, band_keys=n_k, sm_count=sm_count)


def test_no_dq_shares_where_the_single_pass_runs():
    """float32 runs the single pass (no dQ kernel) under both settings where it serves the
    tiles and fills the grid: "dQ: keys cut into 8 shares" was printed all the same."""
    problem = Problem(dtype="float32", head_dim=128, value_dim=128, n_k=131072, **H200)
    line = tiles.describe_with_decode(problem, shape_of(128, 131072, 16, 16))["backward"]
    assert "SINGLE_PASS" in line and "dQ" not in line.split("(SINGLE_PASS")[1], line
    # The deterministic 16-bit two kernels keep their dQ shares.
    half = Problem(dtype="float16", head_dim=64, value_dim=64, n_k=4096, **A100)
    line = tiles.describe_with_decode(half, shape_of(96, 4096, 2, 2, sm_count=108))["backward"]
    assert "deterministic=False: one kernel" in line
    shares = tiles.dq_key_splits(tiles.choose_backward(half).tiles,
                                 shape_of(96, 4096, 2, 2, sm_count=108))
    assert shares > 1 and f"dQ (deterministic=True): keys cut into {shares} shares" in line


def test_a_16_bit_query_tail_states_what_runs():
    """sm_80, float16 D64, Nq 100 (a tail of the 64 streamed rows) over 256 keys, 16 heads
    over 8: neither the single pass nor a group cut runs, and the line said both might."""
    problem = Problem(dtype="float16", head_dim=64, value_dim=64, n_k=256, **A100)
    shape = shape_of(100, 256, 16, 8, sm_count=108)
    key_blocks = 8 * -(-256 // tiles.choose_backward(problem).tiles.dkdv[0])
    assert not tiles.takes_single_pass(key_blocks, 2, 108)
    line = tiles.describe_with_decode(problem, shape)["backward"]
    assert "SINGLE_PASS" not in line and "cut over" not in line, line
    assert "stays whole" in line and "deterministic=False too" in line, line


def test_gqa_is_named_only_where_there_is_a_group():
    problem = Problem(dtype="float32", head_dim=64, value_dim=64, n_k=4096, **H200)
    line = tiles.describe_with_decode(problem, shape_of(4096, 4096, 8, 8))["backward"]
    assert "GQA" not in line and "group" not in line, line
    assert "SINGLE_PASS" in line


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("head_dim", [385, 400, 512, 576])
def test_wide_heads_say_no_row_covers_them(dtype, head_dim):
    """Widths 385-576 blamed the shared memory; no table row covers them."""
    problem = Problem(dtype=dtype, head_dim=head_dim, value_dim=head_dim, n_k=4096, **H200)
    lines = tiles.describe(problem)
    directions = ("forward", "backward") if dtype == "float32" else ("backward",)
    for direction in directions:
        assert f"rows cover head dims above {tiles.WIDE_BACKWARD_DIM}" in lines[direction]
        assert "shared memory" not in lines[direction]
    # Where a row covers the width and none fits, the shared memory is the reason.
    tight = Problem(dtype=dtype, head_dim=320, value_dim=320, n_k=4096, capability=90,
                    shared_limit=32 * 1024)
    assert "fit this device's shared memory" in tiles.describe(tight)["backward"]


def test_the_group_split_search_is_bounded():
    def walked(key_blocks, group, sm_count):  # the rule, by a walk over every split
        target = tiles.BACKWARD_GROUP_WAVES * sm_count
        if group == 1 or key_blocks >= target:
            return 1
        return next(s for s in range(2, group + 1) if group % s == 0 and
                    (key_blocks * s >= target or s == group))

    for key_blocks in (1, 2, 7, 64, 200, 263, 264):
        for group in list(range(1, 300)) + [1009, 1024, 4096, 65536]:
            assert tiles.backward_group_splits(key_blocks, group, 132) == \
                walked(key_blocks, group, 132), (key_blocks, group)
    start = time.perf_counter()
    assert tiles.backward_group_splits(1, 2 ** 31 - 1, 132) == 2 ** 31 - 1  # a prime
    assert tiles.backward_group_splits(1, 2 ** 40, 132) == 512
    assert time.perf_counter() - start < 1


def folded_shares(n_q, n_k, batch, heads, head_dim, value_dim):
    """Key shares of each query row's fold (causal: row r keeps n_k - n_q + r + 1 keys), from
    the fold's own choice (`tiles.folded_choice`), as `_forward_folded` asks it."""
    widest = tiles.fold_value_slices(value_dim)[0][1]
    shares = []
    for row in range(n_q):
        keys = n_k - n_q + row + 1
        problem = Problem(dtype="float16", head_dim=head_dim, value_dim=widest, n_k=keys,
                          query_heads=batch, n_q=heads, multiprocessors=132, **H200)
        choice = tiles.folded_choice(problem, shape_of(heads, keys, 1, 1, batch), False)
        shares.append(choice.key_splits)
    return shares


# --------------------------------------------------------------------------- the GPU backend

STANDIN = textwrap.dedent('''
    import importlib.machinery, json, sys, types
    import numpy as np

    capability, shared_limit, sm_count = {profile}

    class Device:
        id = 0
        compute_capability = str(capability)
        mem_info = (0, 141 * 10 ** 9)
        def __init__(self, *_): pass
        def __enter__(self): return self
        def __exit__(self, *_): return False

    class ndarray(np.ndarray):
        @property
        def device(self):
            return Device()

    properties = {{"multiProcessorCount": sm_count, "sharedMemPerBlockOptin": shared_limit,
                   "name": b"profile", "l2CacheSize": 50 * 2 ** 20}}
    cuda = types.ModuleType("cupy.cuda")
    cuda.Device = Device
    cuda.runtime = types.SimpleNamespace(getDeviceProperties=lambda _: properties,
                                         getDeviceCount=lambda: 1,
                                         CUDARuntimeError=RuntimeError)
    cuda.driver = types.SimpleNamespace(CUDADriverError=RuntimeError)
    cupy = types.ModuleType("cupy")
    cupy.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
    cupy.cuda, cupy.ndarray = cuda, ndarray
    for name in ("uint16", "uint32", "float32", "int32", "int64"):
        setattr(cupy, name, getattr(np, name))
    cupy.lib = types.SimpleNamespace(stride_tricks=types.SimpleNamespace())
    sys.modules.update({{"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.driver": cuda.driver,
                        "cupy.lib": cupy.lib, "cupy.lib.stride_tricks": cupy.lib.stride_tricks}})

    from tileattn import gpu, info
    from tileattn.gpu import launch_forward
    from tileattn.options import UNLIMITED, AttentionOptions

    results = []
    for shape in {cases}:
        lines = []
        info.describe(print_fn=lines.append, **shape)
        start = lines.index(next(line for line in lines if line.startswith("[gpu]")))
        gpu_lines = lines[start:lines.index("", start)]
        causal = shape.get("causal", True)
        options = AttentionOptions(causal=causal, window_right=0 if causal else UNLIMITED)
        n_q, heads = shape["seq_len"], shape.get("heads", 8)
        n_k, kv_heads = shape.get("n_k", n_q), shape.get("kv_heads", heads)
        dtype = np.dtype(shape["dtype"])
        batch, head_dim = shape.get("batch", 1), shape.get("head_dim", 64)
        arrays = [np.broadcast_to(np.zeros((), dtype), (batch, h, n, head_dim)).view(ndarray)
                  for h, n in ((heads, n_q), (kv_heads, n_k), (kv_heads, n_k))]
        choice = launch_forward.choose(*arrays, options)
        results.append({{"lines": gpu_lines, "family": choice.family,
                         "tiles": None if choice.tiles is None else str(choice.tiles),
                         "block_k": getattr(choice.tiles, "block_k", None),
                         "block_q": getattr(choice.tiles, "block_q", None)}})
    print(json.dumps(results))
''')


def gpu_reports(cases, profile=(90, 232448, 132)):
    """What info prints in its [gpu] section for each shape on a CuPy stand-in with this
    device profile (capability, shared memory a block, SMs), beside `launch_forward.choose`'s
    choice for arrays of the shape (dispatch; the forward's oracle)."""
    script = STANDIN.format(profile=profile, cases=repr(cases))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_gpu_tiles_follow_the_chosen_kernel():
    """The tiles line (and the traffic model) read the unmasked table's tiles: a causal D 112
    forward named WgmmaTiles(192, 128) and printed 256 x 64; a decode printed 128 x 128."""
    cases = [dict(seq_len=4096, dtype="float16", head_dim=112),
             dict(seq_len=1, n_k=131072, heads=32, kv_heads=8, dtype="float16"),
             dict(seq_len=128, n_k=131072, heads=16, dtype="float32", head_dim=128,
                  causal=False)]
    for case, result in zip(cases, gpu_reports(cases)):
        forward = line_of(result["lines"], "forward kernel")
        assert result["tiles"] in forward and forward.split(": ", 1)[1].startswith(
            result["family"]), (forward, result)
        block_q = case["seq_len"] if result["family"] == "decode" else result["block_q"]
        assert (f"forward block_q={block_q} block_k={result['block_k']}"
                in line_of(result["lines"], "tiles for this shape")), result["lines"]


def test_gpu_wide_folds_follow_each_rows_keys():
    """Causal rows keep different keys: a fold was claimed where a row keeps none (Nk < Nq),
    and each row's key shares were those of the longest."""
    cases = [dict(seq_len=3, n_k=1, heads=128, kv_heads=1, head_dim=300, dtype="float16"),
             dict(seq_len=3, n_k=4096, heads=128, kv_heads=1, head_dim=576, batch=4,
                  dtype="float16")]
    none, three = gpu_reports(cases)
    forward = line_of(none["lines"], "forward kernel")
    assert none["family"] == "mma" and "folded" not in forward, forward
    forward = line_of(three["lines"], "forward kernel")
    shares = folded_shares(3, 4096, 4, 128, 576, 576)
    assert shares == [7, 7, 8]
    assert "each of the 3 query rows folded on its own" in forward, forward
    assert "(4094, 4095, 4096) in key shares (7, 7, 8)" in forward, forward


@pytest.mark.parametrize("dtype, forward_refused, backward_refused", [
    ("float64", 513, 257), ("float32", 1025, 769), ("float16", 1025, 769)])
def test_gpu_names_the_shapes_it_refuses(dtype, forward_refused, backward_refused):
    """GenericConfig.kernel refuses head dims whose CUDA-core tiles outgrow shared memory:
    info named a generic kernel for them."""
    dims = (backward_refused - 1, backward_refused, forward_refused - 1, forward_refused)
    results = gpu_reports([dict(seq_len=256, head_dim=d, dtype=dtype) for d in dims])
    refused = "not served on the GPU (backend='cpu')"
    for head_dim, result in zip(dims, results):
        forward = line_of(result["lines"], "forward kernel")
        backward = line_of(result["lines"], "backward kernel")
        tiles_line = line_of(result["lines"], "tiles for this shape")
        assert (refused in backward) == (head_dim >= backward_refused), backward
        assert (refused in forward) == (head_dim >= forward_refused), forward
        assert ("backward not served" in tiles_line) == (head_dim >= backward_refused)
        assert ("forward not served" in tiles_line) == (head_dim >= forward_refused)
