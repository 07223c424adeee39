"""The GPU backend's tile tables and family choice (tileattn/gpu/tiles.py), which import no
CuPy: they run everywhere, for the devices the tables are written for."""

from __future__ import annotations

import itertools

import pytest

from tileattn.gpu import tiles
from tileattn.gpu.tiles import Choice, MmaBackwardTiles, Problem, Widths

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
    (Problem(dtype="float16", head_dim=600, value_dim=64, n_k=100, **H100), "above 576"),
    (Problem(dtype="float32", head_dim=64, value_dim=580, n_k=100, **H100), "above 576"),
    (Problem(dtype="float64", head_dim=64, value_dim=64, n_k=100, **A100), "CUDA cores"),
    (Problem(75, 64 * 1024, "float16", 64, 64, 100), "sm_80"),
    (Problem(75, 64 * 1024, "float32", 64, 64, 100), "sm_80"),
])
def test_what_runs_on_cuda_cores_and_why(problem, reason):
    for choose in (tiles.choose_forward, tiles.choose_backward):
        choice = choose(problem)
        assert choice.family == "generic" and choice.tiles is None
        assert reason in choice.note


def test_float64_on_fp64_tensor_cores_to_128():
    """sm_90 runs float64's forward and backward on FP64 tensor cores at D and Dv up to 128,
    in its shared memory (the backward's dK and dV apart above 64); wider rows, named tile
    sizes and sm_80 (no m16n8k8.f64) run the generic kernels."""
    for head_dim, value_dim in ((1, 1), (8, 8), (33, 17), (64, 64), (72, 128), (128, 128),
                                (128, 40)):
        problem = Problem(dtype="float64", head_dim=head_dim, value_dim=value_dim, n_k=4096,
                          **H100)
        widths = tiles.Widths.of(problem, 8)
        choice = tiles.choose_forward(problem)
        assert choice.family == "f64" and isinstance(choice.tiles, tiles.F64Tiles), choice
        assert choice.tiles.shared_bytes(widths) <= problem.shared_limit
        choice = tiles.choose_backward(problem)
        assert choice.family == "f64", (problem, choice)
        assert tiles.backward_fits(choice.tiles, widths, problem.shared_limit, 8)
        assert choice.tiles.split == (widths.widest > 64) and not choice.tiles.paired
    for fields, reason in [(dict(head_dim=136, value_dim=136), "above 128"),
                           (dict(head_dim=64, value_dim=256), "above 128"),
                           (dict(head_dim=64, value_dim=64, block_q=64), "named")]:
        choice = tiles.choose_forward(Problem(dtype="float64", n_k=4096, **fields, **H100))
        assert choice.family == "generic" and reason in choice.note, (fields, choice)
    for problem in (Problem(dtype="float64", head_dim=136, value_dim=136, n_k=4096, **H100),
                    Problem(dtype="float64", head_dim=64, value_dim=64, n_k=4096, **A100)):
        assert tiles.choose_backward(problem).family == "generic"
        assert tiles.choose_forward(problem).family == "generic"


def test_float64_forward_cuts_key_shares():
    """float64's forward cuts the keys of few query tiles into shares (double partials), as
    the other tensor-core forwards do."""
    choice = tiles.Choice("f64", tiles.F64Tiles(128, 16))
    shape = tiles.DecodeShape(n_q=100, group=1, batch_kv_heads=2, batch_q_heads=2,
                              band_keys=8192, sm_count=132)
    splits, why = tiles.forward_key_splits(choice, shape)
    assert splits > 1 and why


@pytest.mark.parametrize("device", [H100, A100], ids=["H100", "A100"])
def test_widths_above_256_on_mma_sync_and_tf32(device):
    """Above 256 the mma.sync forward serves 16-bit widths to 576, its backward and the
    3xTF32 kernels to 384, in the device's shared memory; the rest runs the generic
    kernels, as do wgmma-only problems."""
    def choices(dtype, head_dim, value_dim):
        problem = Problem(dtype=dtype, head_dim=head_dim, value_dim=value_dim, n_k=4096,
                          **device)
        return tiles.choose_forward(problem), tiles.choose_backward(problem)

    for head_dim, value_dim in ((320, 320), (264, 64), (64, 300), (384, 384)):
        for dtype, family in (("float16", "mma"), ("bfloat16", "mma"), ("float32", "tf32")):
            for direction, choice in zip(("forward", "backward"),
                                         choices(dtype, head_dim, value_dim)):
                if choice.family == "generic":  # sm_80's 163 KiB: the note says why
                    assert device is A100 and "shared memory" in choice.note, choice
                    continue
                assert choice.family == family, (dtype, head_dim, direction, choice)
                assert _fits(choice, Problem(dtype=dtype, head_dim=head_dim,
                                             value_dim=value_dim, n_k=4096, **device),
                             direction)
    forward, backward = choices("float16", 576, 512)
    assert forward.family == ("mma" if device is H100 else "generic")
    assert backward.family == "generic"
    assert [c.family for c in choices("float32", 512, 512)] == ["generic", "generic"]


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

    assert forward() == tiles.WgmmaTiles(256, 64, 2)
    assert forward(banded=True) == tiles.WgmmaTiles(128, 64, 2, 2)
    assert forward(head_dim=96, value_dim=96) == tiles.WgmmaTiles(192, 128, 2)
    assert forward(head_dim=80, value_dim=80) == tiles.WgmmaTiles(256, 64, 2)
    assert forward(head_dim=112, value_dim=112) == tiles.WgmmaTiles(256, 64, 2)
    assert forward(head_dim=112, value_dim=112, banded=True) == tiles.WgmmaTiles(192, 128, 2)
    assert forward(n_k=1024) == tiles.WgmmaTiles(128, 64, 2, 2)
    assert forward(score_options=True) == tiles.WgmmaTiles(128, 64, 2, 2)
    assert forward(head_dim=64, value_dim=64, score_options=True) == tiles.WgmmaTiles(128, 128, 2, 2)
    banded = tiles.choose_backward(Problem(dtype="float16", head_dim=128, value_dim=128,
                                           n_k=8192, banded=True, **H100))
    assert banded.tiles.stages == 2
    wide = tiles.choose_backward(Problem(dtype="float16", head_dim=192, value_dim=128,
                                         n_k=8192, **H100))
    # D + Dv > 256 up to 192: dK and dV together over 32 streamed rows; D = 256 apart.
    assert wide.tiles == tiles.WgmmaBackwardTiles((128, 64), (128, 32), 2)
    widest = tiles.choose_backward(Problem(dtype="float16", head_dim=256, value_dim=256,
                                           n_k=8192, **H100))
    assert widest.tiles.split


def test_paged_forwards_take_tiles_within_pages():
    """Paged K/V: Hopper D 65-128 keeps the table's tiles where pages of a power of two hold
    its key tiles (copied as contiguous ones) and takes the four-warpgroup 64-key tiles
    elsewhere, D <= 64 keeps them at every page size; other families shrink their key tiles
    to a page where they are built for that height; named tiles and score options
    (`keep_rows`) and the generic kernels keep theirs."""
    def wgmma(tiles_):
        return Choice("wgmma", tiles_, "row")

    banded_128 = wgmma(tiles.WgmmaTiles(128, 64, 2, 2))
    for page in (64, 128, 256):
        assert tiles.within_pages(banded_128, page, 128, False) == banded_128
    for page in (1, 16, 32, 192):  # spanned, or not a power of two
        assert tiles.within_pages(banded_128, page, 128, False).tiles == tiles.WGMMA_PAGED
    wide_keys = wgmma(tiles.WgmmaTiles(192, 128, 2))
    assert tiles.within_pages(wide_keys, 64, 128, False).tiles == tiles.WGMMA_PAGED
    assert tiles.within_pages(wide_keys, 256, 128, False) == wide_keys
    d64 = wgmma(tiles.WgmmaTiles(128, 128, 2, 2))
    for page in (1, 16, 64, 192, 256):  # D <= 64: the table's tiles at every page size
        assert tiles.within_pages(d64, page, 64, False) == d64
    options_row = wgmma(tiles.WgmmaTiles(192, 128, 2))
    assert tiles.within_pages(options_row, 64, 128, True).tiles == tiles.WgmmaTiles(192, 64, 2)
    assert tiles.within_pages(options_row, 16, 128, True) == options_row  # no 16-key wgmma
    mma = Choice("mma", tiles.MmaTiles(128, 128), "row")
    assert tiles.within_pages(mma, 64, 128, False).tiles == tiles.MmaTiles(128, 64)
    assert tiles.within_pages(mma, 32, 256, False).tiles == tiles.MmaTiles(128, 32)
    generic = Choice("generic", None, "row")
    assert tiles.within_pages(generic, 16, 128, False) == generic


def test_widths_pad_to_the_tensor_cores_k_step():
    assert Widths.padded(33, 100, 16) == Widths(48, 112)
    assert Widths.padded(33, 100, 8) == Widths(40, 104)
    assert Widths.padded(64, 1, 16).widest == 64


def test_describe_names_the_family_row_and_reason():
    lines = tiles.describe(Problem(dtype="bfloat16", head_dim=80, value_dim=80, n_k=4096,
                                   **H100))
    assert set(lines) == {"forward", "backward"}
    assert lines["forward"].startswith("wgmma WgmmaTiles(") and "(" in lines["forward"]
    hopper = tiles.describe(Problem(dtype="float64", head_dim=80, value_dim=80, n_k=4096,
                                    **H100))
    assert hopper["forward"].startswith("f64 F64Tiles(")
    assert hopper["backward"].startswith("f64 MmaBackwardTiles(")
    ampere = tiles.describe(Problem(dtype="float64", head_dim=80, value_dim=80, n_k=4096,
                                    **A100))
    for direction in ("forward", "backward"):
        assert ampere[direction] == ("generic (float64 on CUDA cores: FP64 tensor cores' "
                                     "m16n8k8 needs sm_90)")


@pytest.mark.parametrize("device", [H100, A100], ids=["H100", "A100"])
@pytest.mark.parametrize("dims", [(32, 32), (40, 24), (64, 64), (80, 80), (96, 96),
                                  (128, 128), (160, 160), (192, 192), (256, 256)])
def test_float32_single_pass_serves_the_table_rows_it_fits(device, dims):
    """deterministic=False in float32 runs the single pass on every table row whose dS tile
    fits beside its tiles (the dQ share's column ranges round up past the width), and the
    report says so; its shared memory is the kernel's layout (tiles.shared_bytes)."""
    problem = Problem(dtype="float32", head_dim=dims[0], value_dim=dims[1], n_k=4096,
                      **device)
    choice = tiles.choose_backward(problem)
    assert choice.family == "tf32"
    widths = Widths.padded(*dims, 8)
    fits = choice.tiles.shared_bytes("dkdv", widths, 4, True) <= device["shared_limit"]
    assert choice.tiles.single_pass_fits(*dims, 4, device["shared_limit"]) == (
        fits and choice.tiles.serves_single_pass)
    assert ("SINGLE_PASS" in tiles.describe(problem)["backward"]) == (
        choice.tiles.single_pass_fits(*dims, 4, device["shared_limit"]))
    if device is H100:
        assert choice.tiles.single_pass_fits(*dims, 4, device["shared_limit"])


def test_single_pass_needs_whole_columns_and_one_dkdv_kernel():
    limit = H100["shared_limit"]
    table_row = MmaBackwardTiles((128, 32), (128, 32))
    assert table_row.single_pass_fits(128, 128, 4, limit)
    assert not table_row.single_pass_fits(100, 100, 4, limit)  # padded dQ columns
    assert not table_row.single_pass_fits(128, 128, 4, 200 * 1024)  # no room for dS
    assert not MmaBackwardTiles((64, 32), (64, 32), split=True).single_pass_fits(
        64, 64, 4, limit)
    sixteen = MmaBackwardTiles((64, 64), (128, 64))
    assert sixteen.single_pass_fits(64, 64, 2, limit)
    assert not sixteen.single_pass_fits(64, 32, 2, limit)  # 16-bit: D = Dv only
    assert not sixteen.single_pass_fits(72, 72, 2, limit)


# --------------------------------------------------------------------------- decode


def _decode_shape(n_q=1, n_q_heads=32, n_kv_heads=8, batch=1, n_k=131072, sms=132):
    return tiles.DecodeShape(n_q=n_q, group=n_q_heads // n_kv_heads,
                             batch_kv_heads=batch * n_kv_heads, batch_q_heads=batch * n_q_heads,
                             band_keys=n_k, sm_count=sms)


@pytest.mark.parametrize("device", [H100, A100], ids=["H100", "A100"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_decode_takes_every_head_dim_and_row_count_and_fits(device, dtype):
    """Decode shapes of every D/Dv up to 256 and every packed row count up to 64 choose the
    decode kernel, with a configuration that fits shared memory and holds the rows."""
    itemsize = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}[dtype]
    for head_dim, value_dim in [(1, 1), (33, 33), (64, 64), (128, 128), (24, 200), (256, 256),
                                (256, 64)]:
        problem = Problem(dtype=dtype, head_dim=head_dim, value_dim=value_dim, n_k=65536,
                          **device)
        for n_q, group in [(1, 1), (1, 8), (4, 4), (16, 1), (8, 8)]:
            shape = _decode_shape(n_q=n_q, n_q_heads=group, n_kv_heads=1)
            choice = tiles.choose_decode(problem, shape)
            if choice is None:  # Q alone (64 rows x 256 float64) outgrows shared memory
                assert dtype == "float64" and n_q * group == 64 and head_dim == 256
                continue
            assert choice.family == "decode", (head_dim, n_q, group)
            config = choice.tiles
            if isinstance(config, tiles.DecodeMmaTiles):
                assert config.rows * config.row_groups(n_q * group) >= n_q * group
                assert dtype in ("float16", "bfloat16") and config.block_k % 16 == 0
                shared = config.shared_bytes(head_dim, value_dim)
            else:
                assert config.rows >= n_q * group and config.threads % config.block_k == 0
                shared = config.shared_bytes(itemsize, 8 if dtype == "float64" else 4,
                                             head_dim, value_dim)
            assert shared <= problem.shared_limit


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_short_caches_decode_with_one_split(dtype):
    """A cache of one key to a few tiles decodes (the prefill would pad each row to a tile
    and read K/V once per query head); batches that fill the GPU take one split, one K/V
    head alone splits its few tiles two to a split at most."""
    for n_k in (1, 17, 200):
        problem = Problem(dtype=dtype, head_dim=128, value_dim=128, n_k=n_k, **H100)
        for heads, kv_heads, batch in [(32, 8, 256), (32, 32, 128), (8, 1, 1)]:
            choice = tiles.choose_decode(problem, _decode_shape(
                n_q_heads=heads, n_kv_heads=kv_heads, batch=batch, n_k=n_k))
            assert choice is not None, (n_k, heads, kv_heads)
            most = 1 if batch > 1 else max(1, -(-n_k // choice.tiles.block_k) // 2)
            assert choice.tiles.splits <= most, (n_k, heads, kv_heads, choice)


@pytest.mark.parametrize("device", [H100, A100], ids=["H100", "A100"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_decode_of_many_packed_rows_holds_them_in_row_groups_that_fit(device, dtype):
    """Wherever the decode takes more than 64 packed rows (wide groups, speculative rows),
    its blocks hold every row (row groups) and fit the device's shared memory."""
    itemsize = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}[dtype]
    decoded = 0
    for head_dim, value_dim in [(64, 64), (40, 40), (128, 128), (256, 256), (576, 512)]:
        problem = Problem(dtype=dtype, head_dim=head_dim, value_dim=value_dim, n_k=32768,
                          **device)
        for n_q, group in [(1, 71), (1, 128), (2, 71), (4, 71), (9, 16), (3, 100), (1, 1024)]:
            shape = _decode_shape(n_q=n_q, n_q_heads=group, n_kv_heads=1, batch=2, n_k=32768)
            choice = tiles.choose_decode(problem, shape)
            if choice is None:
                continue
            decoded += 1
            config = choice.tiles
            assert config.rows * config.row_groups(shape.rows) >= shape.rows
            assert tiles.decode_fits(problem, config), (head_dim, n_q, group, config)
            if isinstance(config, tiles.DecodeTiles):
                shared = config.shared_bytes(itemsize, 8 if dtype == "float64" else 4,
                                             head_dim, value_dim)
            else:
                shared = config.shared_bytes(head_dim, value_dim)
            assert shared <= problem.shared_limit
    assert decoded >= 10  # one query row of 71 or 128 heads decodes at every width served


def test_decode_leaves_prefill_shapes_alone():
    problem = Problem(dtype="float16", head_dim=128, value_dim=128, n_k=4096, **H100)
    # Many rows per K/V head with a full prefill grid, no key kept, named tile sizes, sm_75.
    assert tiles.choose_decode(problem, _decode_shape(n_q=128, batch=8)) is None
    # 32 rows a kv head: prefill for float32 (CUDA-core decode products); 16-bit decodes on
    # tensor cores, reading K/V once per group instead of once per query head.
    wide = Problem(dtype="float32", head_dim=128, value_dim=128, n_k=4096, **H100)
    assert tiles.choose_decode(wide, _decode_shape(n_q=8, batch=64)) is None
    assert isinstance(tiles.choose_decode(problem, _decode_shape(n_q=8, batch=64)).tiles,
                      tiles.DecodeMmaTiles)
    assert tiles.choose_decode(problem, _decode_shape(n_k=0)) is None
    named = Problem(dtype="float16", head_dim=128, value_dim=128, n_k=4096, block_k=64, **H100)
    assert tiles.choose_decode(named, _decode_shape()) is None
    old = Problem(dtype="float16", head_dim=128, value_dim=128, n_k=4096, capability=75,
                  shared_limit=64 * 1024)
    assert tiles.choose_decode(old, _decode_shape()) is None
    # 32 rows where prefill would leave SMs idle (B = 1, 8 query heads): decode.
    assert tiles.choose_decode(problem, _decode_shape(n_q=4, n_q_heads=8, n_kv_heads=1)) \
        is not None


def test_more_rows_decode_on_tensor_cores_where_the_prefill_pads_far_more():
    """More than 64 packed rows take the tensor-core decode (eight row warps of one m16
    tile, row groups of 128 rows beyond) where the prefill's padded rows (each query head's
    Nq in tiles of 64) are at least DECODE_MMA_PREFILL_RATE times the decode's, whatever
    the grid; otherwise, in float32, and for MHA beyond 16 queries (32 in float32), the
    prefill (whose keys split where its grid is small)."""
    problem = Problem(dtype="float16", head_dim=128, value_dim=128, n_k=8192, **H100)
    few = _decode_shape(n_q=16, n_q_heads=16, n_kv_heads=2, batch=2, n_k=8192)  # 128 rows
    chosen = tiles.choose_decode(problem, few)
    assert isinstance(chosen.tiles, tiles.DecodeMmaTiles)
    assert (chosen.tiles.row_warps, chosen.tiles.row_tiles) == (8, 1)
    assert chosen.tiles.rows * chosen.tiles.row_groups(128) >= 128
    for batch in (4, 8):  # 68 rows: 80 padded against 4 x 64, with or without idle SMs
        gqa = _decode_shape(n_q=17, n_q_heads=32, n_kv_heads=8, batch=batch, n_k=8192)
        assert isinstance(tiles.choose_decode(problem, gqa).tiles, tiles.DecodeMmaTiles)
    even = _decode_shape(n_q=32, n_q_heads=32, n_kv_heads=8, batch=4, n_k=8192)
    assert tiles.choose_decode(problem, even) is None  # 128 rows against 4 x 64: 2x
    falcon = _decode_shape(n_q=1, n_q_heads=71, n_kv_heads=1, batch=8, n_k=32768)
    chosen = tiles.choose_decode(problem, falcon)  # 80 padded rows against 71 x 64
    assert isinstance(chosen.tiles, tiles.DecodeMmaTiles) and chosen.tiles.row_groups(71) == 1
    narrow = Problem(dtype="float16", head_dim=64, value_dim=64, n_k=32768, **H100)
    chosen = tiles.choose_decode(narrow, falcon)  # D 64: four row warps of two m16 tiles
    assert (chosen.tiles.row_warps, chosen.tiles.row_tiles) == (4, 2)
    speculative = _decode_shape(n_q=4, n_q_heads=71, n_kv_heads=1, batch=8, n_k=32768)
    chosen = tiles.choose_decode(problem, speculative)  # 284 rows: three blocks of 128
    assert (chosen.tiles.rows, chosen.tiles.row_groups(284)) == (128, 3)
    more = _decode_shape(n_q=20, n_q_heads=16, n_kv_heads=2, batch=2, n_k=8192)  # 160 rows
    assert tiles.choose_decode(problem, more).tiles.row_groups(160) == 2  # 160 against 512
    many = _decode_shape(n_q=40, n_q_heads=8, n_kv_heads=1, batch=1, n_k=8192)  # 320 rows
    assert tiles.choose_decode(problem, many) is None  # against 8 x 64
    mha = _decode_shape(n_q=100, n_q_heads=16, n_kv_heads=16, batch=4, n_k=8192)
    assert tiles.choose_decode(problem, mha) is None  # over 64 queries a head
    for n_q in (17, 33, 64):  # MHA beyond 16 queries: no group shares the reads
        mha = _decode_shape(n_q=n_q, n_q_heads=16, n_kv_heads=16, batch=1, n_k=8192)
        assert tiles.choose_decode(problem, mha) is None
    mha16 = _decode_shape(n_q=16, n_q_heads=16, n_kv_heads=16, batch=1, n_k=8192)
    assert tiles.choose_decode(problem, mha16) is not None
    wide = Problem(dtype="float32", head_dim=128, value_dim=128, n_k=8192, **H100)
    for n_q, decodes in ((17, True), (32, True), (33, False), (64, False)):  # float32 MHA
        mha = _decode_shape(n_q=n_q, n_q_heads=16, n_kv_heads=16, batch=1, n_k=8192)
        assert (tiles.choose_decode(wide, mha) is not None) == decodes, n_q
    assert tiles.choose_decode(wide, few) is None  # 128 rows against 8 x 64: the prefill


def test_more_rows_decode_on_cuda_cores_in_row_groups_where_the_prefill_pads_far_more():
    """float32 (and float64, dropout, D above 256) decodes of more than 64 packed rows take
    the CUDA-core decode in row groups of 64 (fewer where wide rows do not fit) where the
    prefill's padded rows are DECODE_CUDA_CORE_PREFILL_RATE times theirs."""
    falcon = _decode_shape(n_q=1, n_q_heads=71, n_kv_heads=1, batch=8, n_k=32768)
    mla = _decode_shape(n_q=2, n_q_heads=128, n_kv_heads=1, batch=2, n_k=8192)
    for dtype in ("float32", "float64"):
        problem = Problem(dtype=dtype, head_dim=64, value_dim=64, n_k=32768, **H100)
        chosen = tiles.choose_decode(problem, falcon)
        assert isinstance(chosen.tiles, tiles.DecodeTiles) and chosen.tiles.rows == 64
        assert chosen.tiles.row_groups(71) == 2 and "2 row groups" in chosen.note
        assert chosen.tiles.shared_bytes(4 if dtype == "float32" else 8,
                                         4 if dtype == "float32" else 8, 64, 64) \
            <= problem.shared_limit
        wide = Problem(dtype=dtype, head_dim=576, value_dim=512, n_k=8192, **H100)
        chosen = tiles.choose_decode(wide, mla)  # 256 rows of 576 and 512 columns
        assert chosen is not None and tiles.decode_fits(wide, chosen.tiles)
        assert chosen.tiles.rows * chosen.tiles.row_groups(256) >= 256
    gqa = _decode_shape(n_q=9, n_q_heads=32, n_kv_heads=4, batch=1, n_k=32768)  # 72 rows
    problem = Problem(dtype="float32", head_dim=128, value_dim=128, n_k=32768, **H100)
    assert tiles.choose_decode(problem, gqa) is None  # 8 x 64 against 8 x 128: the prefill


def test_gqa_group_splits_reach_two_waves():
    assert tiles.backward_group_splits(128, 16, 132) == 4  # 512 blocks >= 264
    assert tiles.backward_group_splits(100, 6, 132) == 3  # 2 gives 200, 3 gives 300
    assert tiles.backward_group_splits(10, 4, 132) == 4  # the whole group at most
    assert tiles.backward_group_splits(300, 8, 132) == 1  # two waves already
    assert tiles.backward_group_splits(4, 1, 132) == 1  # MHA


def test_single_pass_takes_grids_that_fill_their_waves():
    assert tiles.takes_single_pass(4, 1, 132)  # MHA: no group to cut
    assert tiles.takes_single_pass(300, 8, 132)  # two waves already: nothing cut
    assert tiles.takes_single_pass(128, 16, 132)  # MQA B4 N4k: one wave 0.97 full
    assert tiles.takes_single_pass(256, 8, 132)  # two waves 0.97 full
    assert not tiles.takes_single_pass(32, 16, 132)  # MQA B1 N4k: 32 of 132 SMs
    assert not tiles.takes_single_pass(150, 8, 132)  # a second wave of 18 blocks


def test_decode_splits_fill_the_device():
    """One (batch, kv head) is split toward one wave of resident blocks, never past it; a grid
    that fills half the resident blocks is not split; a split keeps at least two key tiles;
    the count is capped."""
    # Dropout keeps float16 on the CUDA-core kernel.
    problem = Problem(dtype="float16", head_dim=128, value_dim=128, n_k=262144,
                      per_row_options=True, dropout=True, **H100)
    single = tiles.choose_decode(problem, _decode_shape(n_q_heads=8, n_kv_heads=1,
                                                        n_k=262144)).tiles
    assert isinstance(single, tiles.DecodeTiles)
    shared = single.shared_bytes(2, 4, 128, 128)
    per_sm = tiles.decode_blocks_per_sm(shared, single.threads, problem.shared_limit)
    assert per_sm == 3  # 57 KiB a block (8 rows) and 1 KiB reserved: 3 fit 228 KiB
    resident = per_sm * 132
    assert single.splits == min(resident, tiles.DECODE_MAX_SPLITS)
    full = tiles.choose_decode(problem, _decode_shape(batch=64, n_k=4096)).tiles
    assert full.splits == 1  # 512 blocks: more than half of 528
    some = tiles.choose_decode(problem, _decode_shape(batch=8, n_k=32768)).tiles
    assert some.splits == 8  # 64 x 8 = 512 blocks in one wave of 528, not 9 (576)
    short = tiles.choose_decode(problem, _decode_shape(n_q_heads=1, n_kv_heads=1,
                                                       n_k=256)).tiles
    assert short.splits == 256 // short.block_k // tiles.DECODE_MIN_TILES_PER_SPLIT


def test_decode_splits_even_out_a_mostly_empty_last_wave():
    """Grids past half a wave stay whole unless their last wave runs mostly empty: 512
    blocks in 396 slots (3 an SM) fill 0.65 of two waves, 3 splits 0.97 of four; 512 in 528
    or 256 in 264 stay one split, and a split still keeps two key tiles."""
    def splits(blocks, per_sm, n_k=65536):
        shape = tiles.DecodeShape(n_q=1, group=1, batch_kv_heads=blocks, batch_q_heads=blocks,
                                  band_keys=n_k, sm_count=132)
        return tiles.decode_splits(shape, 64, per_sm)[0]
    assert splits(512, 3) == 3
    assert splits(512, 4) == 1 and splits(256, 2) == 1 and splits(2048, 4) == 1
    assert splits(512, 3, n_k=256) == 2  # four key tiles: two a split at most
    assert splits(512, 3, n_k=128) == 1
    # 32 packed rows at D 64 (B64 H32/8 Nq8) take stages of 16 keys a warp, 4 blocks an SM:
    # their 512 blocks fill one wave, no split (DECODE_MMA_NARROW_PAIR_KEYS)
    problem = Problem(dtype="float16", head_dim=64, value_dim=64, n_k=131072, **H100)
    choice = tiles.choose_decode(problem, _decode_shape(batch=64, n_q_heads=32, n_kv_heads=8,
                                                        n_q=8, n_k=131072))
    assert (choice.tiles.rows, choice.tiles.block_k, choice.tiles.stages,
            choice.tiles.splits) == (32, 32, 3, 1), choice
    assert tiles.decode_residency(problem, choice.tiles) == 4


def test_tensor_core_decode_merges_few_partials_in_the_kernel():
    """The last block of each group merges the splits while one block's partials are few
    (splits x its rows x Dv <= DECODE_FUSED_MERGE_FLOATS); many splits keep the merge
    kernel, one split needs no merge; `info`'s note names which."""
    problem = Problem(dtype="float16", head_dim=128, value_dim=128, n_k=131072, **H100)
    few = tiles.choose_decode(problem, _decode_shape(batch=8, n_k=4096))
    assert few.tiles.splits == 6 and tiles.decode_merges_in_kernel(few.tiles, 4, 128, 128)
    assert "the last block of each group merges the splits" in few.note
    many = tiles.choose_decode(problem, _decode_shape(batch=1, n_k=131072))
    assert many.tiles.splits == 49  # 49 x 4 rows x 128 = 25K floats
    assert not tiles.decode_merges_in_kernel(many.tiles, 4, 128, 128)
    assert "the merge kernel combines the splits" in many.note
    # 792 blocks: two whole waves of 396 (3 an SM)
    whole = tiles.choose_decode(problem, _decode_shape(batch=99, n_k=4096))
    assert whole.tiles.splits == 1 and not tiles.decode_merges_in_kernel(whole.tiles, 4, 128,
                                                                         128)
    assert "merge" not in whole.note


def test_tensor_core_decode_splits_fill_the_device():
    """The same rule for the tensor-core kernel, whose residency is set by its shared memory
    and registers: at D = 128, 72 KiB and 168 registers a thread keep 3 blocks an SM."""
    problem = Problem(dtype="float16", head_dim=128, value_dim=128, n_k=262144, **H100)
    single = tiles.choose_decode(problem, _decode_shape(n_q_heads=8, n_kv_heads=1,
                                                        n_k=262144)).tiles
    assert isinstance(single, tiles.DecodeMmaTiles) and single.rows == 16
    assert single.stages == 2 and single.block_k == 64
    shared = single.shared_bytes(128, 128)
    assert shared == 2 * 64 * (128 + 128 + 16) * 2 + 16 * 136 * 2
    per_sm = tiles.decode_blocks_per_sm(shared, single.threads, problem.shared_limit,
                                        single.registers(128, 128))
    assert per_sm == 3
    assert single.splits == 3 * 132
    some = tiles.choose_decode(problem, _decode_shape(batch=8, n_k=32768)).tiles
    assert some.splits == 6  # 64 x 6 = 384 blocks in one wave of 396


@pytest.mark.parametrize("head_dim, stages", [(64, 2), (96, 2), (128, 2), (256, 3)])
def test_tensor_core_decode_takes_a_third_stage_where_a_block_has_its_sm_alone(head_dim,
                                                                               stages):
    """A block alone on its SM (D = 256) streams through three stages, so that two tiles are
    in flight while it computes; where 2-4 blocks share an SM, their copies overlap each
    other's products and a third stage would only cost shared memory (two stages)."""
    problem = Problem(dtype="float16", head_dim=head_dim, value_dim=head_dim, n_k=32768,
                      **H100)
    chosen = tiles.decode_mma_tiles(problem, _decode_shape(n_k=32768))
    assert chosen.stages == stages
    assert (tiles.decode_residency(problem, chosen) == 1) == (stages == 3)
    assert tiles.decode_mma_tiles(problem, _decode_shape(n_k=32768), stages=2).stages == 2


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("n_q_heads, n_q", [(8, 1), (32, 1), (32, 8), (32, 16), (64, 16)])
def test_tensor_core_decode_rows_have_measured_registers(head_dim, n_q_heads, n_q):
    """Every tile shape the tensor-core decode's table picks at the common head dims has its
    ptxas register count in DECODE_MMA_REGISTERS (the residency the splits assume comes from
    it, not from the estimate): a change to the table's warps or keys must measure them
    again (bench/experiments/compile_check_gpu.py --decode-registers)."""
    problem = Problem(dtype="float16", head_dim=head_dim, value_dim=head_dim, n_k=32768,
                      **H100)
    shape = _decode_shape(n_q=n_q, n_q_heads=n_q_heads, n_kv_heads=8 if n_q_heads > 8 else 1,
                          n_k=32768)
    chosen = tiles.decode_mma_tiles(problem, shape)
    key = (head_dim, head_dim, chosen.row_tiles, chosen.row_warps, chosen.warps,
           chosen.warp_keys)
    assert key in tiles.DECODE_MMA_REGISTERS, chosen
    assert chosen.registers(head_dim, head_dim) == tiles.DECODE_MMA_REGISTERS[key]


def test_tensor_core_decode_serves_16_bit_rows_without_dropout():
    """16-bit inputs from one packed row up to 64, in blocks of what O's registers hold (16
    rows a warp at Dv = 256, 32 at 128, 64 at 64; more rows take row warps, up to four,
    and forced tiles with fewer row warps cut them into row groups, a block each, counted as
    blocks by the split rule), ALiBi included (a slope per packed row); float32, float64
    and dropout stay on CUDA cores."""
    def kernel(dtype="float16", value_dim=128, n_q=1, group=4, alibi=False, dropout=False):
        problem = Problem(dtype=dtype, head_dim=128, value_dim=value_dim, n_k=65536,
                          per_row_options=alibi or dropout, dropout=dropout, **H100)
        choice = tiles.choose_decode(problem, _decode_shape(n_q=n_q, n_q_heads=group,
                                                            n_kv_heads=1))
        return type(choice.tiles).__name__

    assert kernel() == kernel(dtype="bfloat16") == "DecodeMmaTiles"
    assert kernel(dtype="float32") == kernel(dtype="float64") == "DecodeTiles"
    assert kernel(alibi=True) == kernel(dtype="bfloat16", alibi=True) == "DecodeMmaTiles"
    assert kernel(alibi=True, n_q=4, group=8) == "DecodeMmaTiles"
    assert kernel(dropout=True) == kernel(alibi=True, dropout=True) == "DecodeTiles"
    assert kernel(group=1) == "DecodeMmaTiles"
    assert kernel(value_dim=256, group=16) == "DecodeMmaTiles"
    assert kernel(value_dim=256, group=32) == "DecodeMmaTiles"  # two row warps
    assert kernel(value_dim=128, n_q=8, group=4) == "DecodeMmaTiles"
    assert kernel(value_dim=64, n_q=16, group=4) == "DecodeMmaTiles"
    problem = Problem(dtype="float16", head_dim=256, value_dim=256, n_k=65536, **H100)
    for n_q, row_warps, warps, warp_keys in ((1, 1, 4, 16), (2, 1, 4, 16), (4, 2, 2, 32),
                                             (8, 4, 1, 32)):
        shape = _decode_shape(n_q=n_q, n_q_heads=8, n_kv_heads=1, batch=8)
        chosen = tiles.choose_decode(problem, shape).tiles
        assert (chosen.row_tiles, chosen.row_warps, chosen.warps, chosen.warp_keys) == (
            1, row_warps, warps, warp_keys)
        assert chosen.row_groups(shape.rows) == 1
    # One row warp (forced) cuts 32 rows of Dv = 256 into two row groups, which the split
    # rule counts as blocks: 16 blocks a wave where 8 took it.
    shape = _decode_shape(n_q=4, n_q_heads=8, n_kv_heads=1, batch=8)
    grouped = tiles.decode_mma_tiles(problem, shape, row_warps=1, warps=4, warp_keys=16)
    assert grouped.rows == 16 and grouped.row_groups(shape.rows) == 2
    one_group = tiles.choose_decode(problem, _decode_shape(n_q=1, n_q_heads=8, n_kv_heads=1,
                                                           batch=8)).tiles
    assert grouped.splits == one_group.splits // 2


def test_describe_names_the_decode_row():
    problem = Problem(dtype="float16", head_dim=128, value_dim=128, n_k=131072, **H100)
    lines = tiles.describe_with_decode(problem, _decode_shape())
    assert lines["forward"].startswith("decode DecodeMmaTiles(row_tiles=1")
    wide = Problem(dtype="float32", head_dim=128, value_dim=128, n_k=131072, **H100)
    assert tiles.describe_with_decode(wide, _decode_shape())["forward"].startswith(
        "decode DecodeTiles(rows=4")
    assert "splits" in lines["forward"] and lines["backward"].startswith("wgmma")
    assert tiles.describe_with_decode(problem, None) == tiles.describe(problem)
    falcon = _decode_shape(n_q=1, n_q_heads=71, n_kv_heads=1, batch=8, n_k=32768)
    line = tiles.describe_with_decode(wide, falcon)["forward"]
    assert line.startswith("decode DecodeTiles(rows=64") and "2 row groups of 64 rows" in line


def test_dense_backwards_of_few_query_rows_take_smaller_tiles():
    """Hopper, 16-bit D = 128: a dense backward of at most 32 query rows takes 64-row dQ and
    dK/dV blocks, of up to 128 rows 128-row dQ blocks over 64-key dK/dV blocks; more rows,
    or an unknown count (variable-length calls), keep the row of any Nq."""
    def backward(n_q, head_dim=128, **fields):
        problem = Problem(dtype="float16", head_dim=head_dim, value_dim=head_dim, n_k=32768,
                          n_q=n_q, **fields, **H100)
        return tiles.choose_backward(problem).tiles

    few, some = (tiles.WgmmaBackwardTiles((64, 64), (64, 64), 2),
                 tiles.WgmmaBackwardTiles((128, 64), (64, 64), 2))
    assert backward(1) == backward(32) == backward(32, banded=True) == few
    assert backward(33) == backward(128) == backward(100, score_options=True) == some
    assert backward(129) == backward(0) == tiles.WgmmaBackwardTiles((192, 64), (128, 64), 3)
    assert backward(0, banded=True) == backward(4096, banded=True) != some
    assert backward(1, head_dim=64) == backward(0, head_dim=64)  # not swept below D = 113


def test_forward_grids_of_few_waves_take_two_blocks_per_multiprocessor():
    """Hopper, D = 128 without a band: a forward grid under 8 waves of 192-row blocks (B = 1
    prefill, a short query block over a long cache) takes 128-row tiles at two blocks per
    multiprocessor, a full grid or an unknown one (the backward, variable-length calls)
    256-row tiles; D <= 64 takes two 128-row blocks per multiprocessor at any grid; other
    widths and score options keep their rows."""
    def forward(head_dim, query_heads, n_q, n_k=8192, **fields):
        problem = Problem(dtype="float16", head_dim=head_dim, value_dim=head_dim, n_k=n_k,
                          query_heads=query_heads, n_q=n_q, multiprocessors=132, **fields,
                          **H100)
        return tiles.choose_forward(problem).tiles

    assert forward(128, 16, 4096) == tiles.WgmmaTiles(128, 64, 2, 2)
    assert forward(128, 64, 512) == tiles.WgmmaTiles(128, 64, 2, 2)
    assert forward(64, 32, 8192) == tiles.WgmmaTiles(128, 128, 2, 2)
    assert forward(128, 64, 16384) == tiles.WgmmaTiles(256, 64, 2)  # 43 waves
    assert forward(64, 128, 16384) == tiles.WgmmaTiles(128, 128, 2, 2)
    assert forward(128, 0, 0) == tiles.WgmmaTiles(256, 64, 2)
    assert forward(96, 16, 4096) == forward(96, 0, 0)
    assert forward(128, 16, 4096, score_options=True) == forward(128, 0, 0, score_options=True)
    assert Problem(dtype="float16", head_dim=64, value_dim=64, n_k=1, query_heads=10, n_q=400,
                   multiprocessors=4, **H100).waves(192, 1) == 10 * 3 / 4


def test_short_sequences_take_one_warpgroup_blocks():
    """Hopper, 16-bit: over <= 64 keys (<= 128 under a band at D <= 64) the forward takes
    64-row, 64-key blocks at D <= 128 (four an SM at D <= 64), which a 128-row or 128-key
    tile would leave half empty; over <= 512 keys the backward's dQ and dK/dV blocks are 64 x 64 at D <= 64 and
    D = 128. Longer sequences, score options in the forward and unswept widths keep their
    rows."""
    def choose(head_dim, n_k, direction=tiles.choose_forward, **fields):
        problem = Problem(dtype="float16", head_dim=head_dim, value_dim=head_dim, n_k=n_k,
                          **fields, **H100)
        return direction(problem).tiles

    four_an_sm = tiles.WgmmaTiles(64, 64, 2, 4)
    assert choose(64, 64) == choose(32, 1) == choose(64, 128, banded=True) == four_an_sm
    assert choose(64, 128) == choose(64, 64, score_options=True) == choose(64, 4096)
    assert choose(80, 64) == choose(96, 33) == tiles.WgmmaTiles(64, 64, 2, 2)
    assert choose(128, 64) == choose(112, 64) == tiles.WgmmaTiles(64, 64, 3)
    assert choose(128, 128) == tiles.WgmmaTiles(128, 64, 2, 2)
    assert choose(96, 65) == choose(96, 1024) and choose(160, 64) == choose(160, 4096)
    small = tiles.WgmmaBackwardTiles((64, 64), (64, 64), 2)
    for head_dim in (64, 128):
        for n_k in (1, 64, 512):
            assert choose(head_dim, n_k, tiles.choose_backward) == small
            assert choose(head_dim, n_k, tiles.choose_backward, n_q=4096, banded=True) == small
        assert choose(head_dim, 513, tiles.choose_backward) != small
    assert choose(96, 64, tiles.choose_backward) == choose(96, 4096, tiles.choose_backward)


def test_describe_names_the_gqa_cut_of_the_backward():
    """`python -m tileattn info` says where the backward cuts GQA groups over blocks: MQA
    at B = 4 and 4k keys, not MHA, not a 16-bit query tail, not a grid of two waves."""
    problem = Problem(dtype="float16", head_dim=64, value_dim=64, n_k=4096, **H100)

    def backward(n_q=4096, heads=16, kv_heads=1, batch=4):
        shape = tiles.DecodeShape(n_q=n_q, group=heads // kv_heads,
                                  batch_kv_heads=batch * kv_heads, batch_q_heads=batch * heads,
                                  band_keys=4096, sm_count=132)
        return tiles.describe_with_decode(problem, shape)["backward"]

    assert "each group of 16 query heads cut over 4 blocks" in backward()
    assert "cut over" not in backward(kv_heads=16)
    # The 3xTF32 and mma.sync single pass (deterministic=False) where it fits: uncut over
    # one wave 0.97 full (B4 MQA, 128-key blocks) or two (64-key blocks), the cut kept
    # over 32 / 64 blocks (B1).
    for dtype, hardware in (("float32", H100), ("float16", A100)):
        wide = Problem(dtype=dtype, head_dim=128, value_dim=128, n_k=4096, **hardware)
        assert tiles.choose_backward(wide).family in ("mma", "tf32")
        lines = [tiles.describe_with_decode(wide, tiles.DecodeShape(
            n_q=4096, group=16, batch_kv_heads=batch, batch_q_heads=16 * batch,
            band_keys=4096, sm_count=132))["backward"] for batch in (4, 1)]
        who = ("float32 (either setting of deterministic)" if dtype == "float32"
               else "deterministic=False")
        assert f"{who} runs the single pass uncut" in lines[0]
        assert "cut over" in lines[1] and f"{who} too" in lines[1]
    assert "cut over" not in backward(n_q=4000)  # a query tail: keys are flagged instead
    assert "cut over" not in backward(batch=64)


def test_wide_gqa_decode_folds_its_group_into_query_rows():
    """One query row a head, heads wider than the tensor-core decode's, 16-bit, no per-row
    options or named tiles: the group folds into rows of the mma.sync prefill, with key
    shares, where the folded grid fills enough of the device; everything else does not."""
    fold = tiles.folds_group_rows
    assert fold("bfloat16", 576, 512, 1, 16, False, False)
    assert fold("float16", 320, 320, 1, 4, False, False)
    assert not fold("bfloat16", 256, 256, 1, 16, False, False)  # the tensor-core decode's
    assert not fold("bfloat16", 640, 512, 1, 16, False, False)  # above MAX_WIDE_DIM
    assert not fold("float32", 576, 512, 1, 16, False, False)
    assert not fold("bfloat16", 576, 512, 2, 16, False, False)  # rows of one head differ
    # ... unless each query row's group fills 64-row tiles: then one fold a query row.
    assert fold("bfloat16", 576, 512, 2, 128, False, False)
    assert fold("float16", 576, 512, tiles.FOLD_MAX_QUERY_ROWS, 64, False, False)
    assert not fold("float16", 576, 512, tiles.FOLD_MAX_QUERY_ROWS + 1, 128, False, False)
    assert not fold("bfloat16", 576, 512, 1, 1, False, False)  # MHA: nothing to fold
    assert not fold("bfloat16", 576, 512, 1, 16, True, False)  # ALiBi or dropout
    assert not fold("bfloat16", 576, 512, 1, 16, False, True)  # named tile sizes

    def folded(batch, group, decodes=True, n_k=8192, **device):
        problem = Problem(dtype="bfloat16", head_dim=576, value_dim=512, n_k=n_k,
                          query_heads=batch, n_q=group, multiprocessors=132,
                          **(device or H100))
        shape = tiles.DecodeShape(n_q=group, group=1, batch_kv_heads=batch,
                                  batch_q_heads=batch, band_keys=n_k, sm_count=132)
        return tiles.folded_choice(problem, shape, decodes)

    # MLA's decode, B 8, 16 query heads over one K/V head: 8 tiles of 64 rows, keys in 16
    # shares of 512 fill ~a wave of the mma.sync forward's blocks.
    choice = folded(8, 16)
    assert choice.family == "mma" and choice.key_splits == 16
    assert "folded" in choice.note and "shares" in choice.note
    # sm_80's 163 KiB hold no mma.sync tile at 576/512: the generic prefill, so no fold.
    assert tiles.choose_forward(Problem(dtype="bfloat16", head_dim=576, value_dim=512,
                                        n_k=8192, **A100)).family == "generic"
    assert folded(8, 16, **A100) is None
    # B 1-4 over 8k keys: 16-64 folded blocks, under FOLD_MIN_WAVE of a wave, so the
    # decode kernel's many splits stay.
    assert folded(1, 16) is None and folded(4, 16) is None
    # A single sequence's 16 rows over 64k keys: shares of 512 keys, up to FOLD_MAX_SPLITS
    # (more than a prefill's FORWARD_MAX_SPLITS), about a wave.
    assert 100 < folded(1, 16, n_k=65536).key_splits <= tiles.FOLD_MAX_SPLITS
    # 128 query heads a K/V head, more rows than the decode kernel takes: folded at any
    # batch (the unfolded prefill wastes 63 of each 64 rows and reads K/V per query head).
    assert folded(1, 128, decodes=False).key_splits == 16
    assert folded(4, 128).key_splits == 16
    # Values wider than 256 columns run in launches of column slices (O in registers).
    assert tiles.fold_value_slices(512) == ((0, 256), (256, 512))
    assert tiles.fold_value_slices(320) == ((0, 160), (160, 320))
    assert tiles.fold_value_slices(264) == ((0, 144), (144, 264))
    assert tiles.fold_value_slices(64) == ((0, 64),)


def test_many_packed_decode_rows_fold_only_at_the_widths_that_win():
    """A GQA decode of 64 packed rows (B 8, 8 query heads over one K/V head, Nq 8) folds
    onto the wgmma prefill at head dims padded to 64, 128 or 256 (FOLD_DECODE_TILES); dims
    padded to 80-112 stay on the decode kernel, which read their K and V faster; sm_80 has
    no wgmma to fold onto."""
    def folded(head_dim, value_dim, rows=64, **device):
        problem = Problem(dtype="float16", head_dim=head_dim, value_dim=value_dim,
                          n_k=131072, query_heads=8, n_q=rows, multiprocessors=132,
                          **(device or H100))
        shape = tiles.DecodeShape(n_q=rows, group=1, batch_kv_heads=8, batch_q_heads=8,
                                  band_keys=131072, sm_count=132)
        return tiles.folded_choice(problem, shape, True)

    for dims in ((72, 72), (80, 80), (96, 96), (112, 112), (96, 64), (64, 112)):
        assert folded(*dims) is None, dims
    expected = {(64, 64): (64, 128, False), (48, 40): (64, 128, False),
                (128, 128): (64, 128, True), (128, 96): (64, 64, False),
                (120, 128): (64, 128, True), (256, 256): (64, 32, False),
                (192, 128): (64, 32, False)}
    for dims, (block_q, block_k, overlap) in expected.items():
        choice = folded(*dims)
        assert choice.family == "wgmma" and "folded" in choice.note, (dims, choice)
        assert (choice.tiles.block_q, choice.tiles.block_k, choice.tiles.overlap) == \
            (block_q, block_k, overlap), (dims, choice)
        assert 1 < choice.key_splits <= tiles.FOLD_DECODE_MAX_SPLITS, (dims, choice)
    # Above 64 rows D 128 leaves the overlapped tiles for two blocks of 64 keys an SM.
    assert folded(128, 128, rows=128).tiles.block_k == 64
    assert folded(128, 128, **A100) is None


def test_float32_over_few_keys_takes_64_row_tiles():
    """float32 over at most 128 keys (short sequences at large batches, windows of a few
    dozen tokens): 64-row tiles, forward on wgmma (sm_90) or mma.sync (sm_80), and both
    backward kernels; over more keys the wider rows as before."""
    for device, family in ((H100, tiles.Tf32WgmmaTiles), (A100, tiles.Tf32Tiles)):
        for head_dim, n_k in ((32, 49), (64, 64), (64, 128), (128, 128), (96, 100)):
            problem = Problem(dtype="float32", head_dim=head_dim, value_dim=head_dim,
                              n_k=n_k, **device)
            backward = tiles.choose_backward(problem).tiles
            assert backward.dq[0] == backward.dkdv[0] == 64, (head_dim, n_k, backward)
            if head_dim <= 64:
                forward = tiles.choose_forward(problem).tiles
                assert isinstance(forward, family) and forward.block_q == 64
        longer = Problem(dtype="float32", head_dim=64, value_dim=64, n_k=129, **device)
        assert tiles.choose_forward(longer).tiles.block_q == 128
        assert tiles.choose_backward(longer).tiles.dq[0] == 128


def test_float64_query_tails_cut_gqa_groups_as_float32s_do():
    """float64's dK/dV kernels zero a query tail's probabilities as float32's do (16-bit
    ones flag keys for a redo, which keeps GQA groups whole): the backward line says the
    groups are cut, as launch_backward cuts them."""
    shape = tiles.DecodeShape(n_q=100, group=2, batch_kv_heads=8, batch_q_heads=16,
                              band_keys=256, sm_count=132)
    for dtype, says in (("float64", "cut over 2 blocks"), ("float32", "cut over 2 blocks"),
                        ("float16", "stays whole")):
        problem = Problem(dtype=dtype, head_dim=64, value_dim=64, n_k=256, n_q=100, **H100)
        assert says in tiles.describe_with_decode(problem, shape)["backward"], dtype


def test_a_decode_of_too_few_key_tiles_to_split_says_so():
    """One key tile (40 keys) is one split, and the note says why, not that each of the
    splits has two tiles."""
    problem = Problem(dtype="float16", head_dim=64, value_dim=64, n_k=40, **H100)
    shape = tiles.DecodeShape(n_q=1, group=8, batch_kv_heads=4, batch_q_heads=32,
                              band_keys=40, sm_count=132)
    choice = tiles.choose_decode(problem, shape)
    assert choice.tiles.splits == 1
    assert "no split: 1 key tile, under 2 for each of two splits" in choice.note
