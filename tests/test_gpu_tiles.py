"""The GPU backend's tile tables and family choice (tileattn/gpu/tiles.py), which import no
CuPy: they run everywhere, for the devices the tables are written for."""

from __future__ import annotations

import itertools

import pytest

from tileattn.gpu import tiles
from tileattn.gpu.tiles import Choice, Problem, Widths

H100 = dict(capability=90, shared_limit=227 * 1024)
A100 = dict(capability=80, shared_limit=163 * 1024)


def _parts(choice):
    return (1, 2) if getattr(choice.tiles, "split", False) else (0,)


def _fits(choice, problem, direction):
    """Whether the chosen tiles fit the problem's shared memory (every kernel, every part)."""
    step = 8 if choice.family == "tf32" else 16
    widths = Widths.of(problem, step)
    if direction == "forward":
        return choice.tiles.shared_bytes(widths) <= problem.shared_limit
    element = 4 if choice.family == "tf32" else 2
    return all((choice.tiles.shared_bytes(entry, widths, part=part) if choice.family == "wgmma"
                else choice.tiles.shared_bytes(entry, widths, element, part=part))
               <= problem.shared_limit
               for entry in ("dq", "dkdv") for part in _parts(choice))


@pytest.mark.parametrize("device", [H100, A100], ids=["H100", "A100"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_every_head_dim_up_to_256_gets_tensor_cores_that_fit(device, dtype):
    """Each D and Dv up to 256 (every multiple of 8, the odd ones around them, Dv != D both
    ways), with and without a band and score options, short and long rows, both directions:
    a tensor-core family, with tiles that fit the device's shared memory."""
    head_dims = sorted(set(range(8, 257, 8)) | {1, 3, 33, 100, 255})
    expected = {"float32": "tf32"}.get(dtype, "wgmma" if device is H100 else "mma")
    for head_dim, value_dim in itertools.product(head_dims, (None, 64, 256)):
        value_dim = head_dim if value_dim is None else value_dim
        for banded, score_options, n_k in itertools.product((False, True), (False, True),
                                                            (512, 8192)):
            problem = Problem(dtype=dtype, head_dim=head_dim, value_dim=value_dim, n_k=n_k,
                              banded=banded, score_options=score_options, **device)
            for direction, choose in (("forward", tiles.choose_forward),
                                      ("backward", tiles.choose_backward)):
                choice = choose(problem)
                assert choice.family == expected, (problem, direction, choice)
                assert _fits(choice, problem, direction), (problem, direction, choice)
                assert choice.note


@pytest.mark.parametrize("problem, reason", [
    (Problem(dtype="float16", head_dim=264, value_dim=64, n_k=100, **H100), "above 256"),
    (Problem(dtype="float16", head_dim=64, value_dim=300, n_k=100, **H100), "above 256"),
    (Problem(dtype="float64", head_dim=64, value_dim=64, n_k=100, **H100), "CUDA cores"),
    (Problem(75, 64 * 1024, "float16", 64, 64, 100), "sm_80"),
    (Problem(75, 64 * 1024, "float32", 64, 64, 100), "sm_80"),
])
def test_what_runs_on_cuda_cores_and_why(problem, reason):
    for choose in (tiles.choose_forward, tiles.choose_backward):
        choice = choose(problem)
        assert choice.family == "generic" and choice.tiles is None
        assert reason in choice.note


def test_named_tile_sizes():
    """The caller's tile sizes: the wgmma forward where it is built for them, else the
    mma.sync (or 3xTF32) forward where that is, else the generic kernel; the backward always
    runs the generic kernels then, which honour any size."""
    def choice(dtype="float16", **blocks):
        return tiles.choose_forward(Problem(dtype=dtype, head_dim=64, value_dim=64,
                                            n_k=4096, **H100, **blocks))

    assert choice(block_q=128, block_k=64) == Choice(
        "wgmma", tiles.WgmmaTiles(128, 64, 2), "tile sizes named by the caller")
    assert choice(block_q=64, block_k=32).family == "mma"
    assert choice(block_q=7, block_k=13).family == "generic"
    assert choice("float32", block_q=64, block_k=32).tiles == tiles.Tf32Tiles(64, 32, 32)
    assert choice("float32", block_q=64, block_k=128).family == "generic"
    backward = tiles.choose_backward(Problem(dtype="float16", head_dim=64, value_dim=64,
                                             n_k=4096, block_q=128, **H100))
    assert backward.family == "generic" and "named" in backward.note


def test_rows_follow_the_key_count_and_options():
    """The first matching row wins: short rows, score options and bands select their rows."""
    def forward(**fields):
        problem = dict(dtype="float16", head_dim=128, value_dim=128, n_k=8192)
        return tiles.choose_forward(Problem(**{**problem, **fields}, **H100)).tiles

    assert forward() == tiles.WgmmaTiles(192, 128, 2)
    assert forward(n_k=1024) == tiles.WgmmaTiles(128, 64, 2, 2)
    assert forward(score_options=True) == tiles.WgmmaTiles(192, 64, 3)
    banded = tiles.choose_backward(Problem(dtype="float16", head_dim=128, value_dim=128,
                                           n_k=8192, banded=True, **H100))
    assert banded.tiles.stages == 2
    wide = tiles.choose_backward(Problem(dtype="float16", head_dim=192, value_dim=128,
                                         n_k=8192, **H100))
    assert wide.tiles.split  # D + Dv > 256: dK and dV in two kernels


def test_widths_pad_to_the_tensor_cores_k_step():
    assert Widths.padded(33, 100, 16) == Widths(48, 112)
    assert Widths.padded(33, 100, 8) == Widths(40, 104)
    assert Widths.padded(64, 1, 16).widest == 64


def test_describe_names_the_family_row_and_reason():
    lines = tiles.describe(Problem(dtype="bfloat16", head_dim=80, value_dim=80, n_k=4096,
                                   **H100))
    assert set(lines) == {"forward", "backward"}
    assert lines["forward"].startswith("wgmma WgmmaTiles(") and "(" in lines["forward"]
    generic = tiles.describe(Problem(dtype="float64", head_dim=80, value_dim=80, n_k=4096,
                                     **H100))
    assert generic["forward"] == "generic (float64 runs on CUDA cores)"
