"""GPU benchmark: variable-length (packed) and paged attention beside the same work laid out dense.

    python3 bench/bench_gpu_varlen.py [--quick] [--dtype float16] [--backward] [--no-torch]
                                      [--out FILE]

(from the repository root, with PYTHONPATH=. where tileattn is not installed). One process,
GPU 0; every table is printed as it is measured and, with --out, written there as markdown.

1. Packed training batch: `--sequences` (32) sequences with lengths drawn from
   `--min-length`..`--max-length` (128..8192) by numpy's default_rng(0), Hq = Hkv = 16,
   D = 128, float16 and bfloat16, causal and not. Rows, all on the same data:
   * ``packed``: one `tileattn.forward(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)` call, q
     ``(H, N_total, D)``;
   * ``padded, seqlens``: every sequence padded to the longest (B = S, N = longest) with
     `seqlens_q`/`seqlens_k` (same result as packed);
   * ``padded, pad and ignore``: the same padded arrays as a plain dense call (what a user
     without variable lengths runs; non-causal rows then differ by design, padding keys count);
   * ``one dense sequence``: B = 1, N = N_total, for the rate alone;
   * ``torch varlen``: torch.nn.attention.varlen.varlen_attn (or aten's
     _flash_attention_forward with cu_seqlens) where torch has it; 'n/a: reason' otherwise.
   TFLOP/s count FlashAttention's way, real tokens' kept pairs only: forward
   4 * H * sum_s(Nq_s * Nk_s) * D, halved for causal (the padded rows get the same count:
   their padding is wasted work); the one-dense row counts its own pairs. "rate / one-dense"
   is a row's TFLOP/s over the one-dense row's (issue target for packed: >= 0.9), "time /
   packed" a row's time over packed's (padded: the issue's >= 5x; torch varlen: > 1 means
   tileattn is faster). --backward adds forward+backward rows (FLOPs 3.5x the forward's);
   tileattn rows print 'n/a' where the GPU varlen backward raises NotImplementedError.
2. Paged prefill/append: Nq = 512 new tokens after 8192 cached keys (Nk = 8704 per
   sequence, causal aligned bottom-right), page size 64, B = 4, (Hq, Hkv) = (16, 16) and
   (32, 8), D = 128: pages shuffled in the pool ``(num_pages, Hkv, page_size, D)`` by a
   seeded permutation, against the same keys contiguous (a dense call). "contiguous /
   paged" is the time ratio (target >= 0.9).
3. Paged decode: Nq = 1, B = 8, Hq = 32, Hkv = 8, D = 128, per-sequence key counts drawn
   from 1024..8192, page sizes 1, 16, 64, 256, against the same keys contiguous (padded to
   the longest, with seqlens_k). GB/s: bytes of K and V the sequences hold, over the time;
   also timed back to back (calls queued behind the kernels, so host time drops out).
   Parts 2 and 3 run in the first dtype of the run (float16 unless --dtype says otherwise).

Correctness before timing: the packed forward of the first shape against the float64 golden
formula on its first sequence's first head (tileattn.testing's tolerance); then every
variable-length row against tileattn dense run sequence by sequence (a plain dense call per
sequence, assembled) with its max abs diff in the table; a row further off than twice the
dtype's tolerance is printed 'WRONG' and not timed. Paged rows: golden check of batch 0's
first K/V group, max abs diff against the contiguous call.

Timing as in bench_gpu_decode.py: CUDA events around each call, L2 flushed (a 128 MiB
write) before each, two warm-up calls, median of `--repetitions`. Paged and padded-decode
calls are timed with check_lengths=False (their tables were checked on the correctness
call): a serving loop that builds its own tables skips the contents check (docs/varlen.md).
Length arrays: NumPy int32 for packed and padded training batches (host metadata, as
training loops hold it), CuPy int32 for the paged tables and decode lengths.
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
import traceback
from dataclasses import dataclass

import numpy as np
from gpu_timing import back_to_back_ms, median_event_ms
from paged_pools import page_pool

cupy = None  # imported in main(), so that --help and argument errors need no GPU
torch = None  # imported in main() unless --no-torch

DTYPES = ("float16", "bfloat16")
HEADS, HEAD_DIM = 16, 128


# --------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="8 sequences of 128..2048 tokens, float16 only, 10 repetitions")
    parser.add_argument("--dtype", choices=DTYPES, action="append", default=None,
                        help="run this dtype (repeatable; default: both, --quick: float16)")
    parser.add_argument("--backward", action="store_true",
                        help="add forward+backward rows to the packed training table")
    parser.add_argument("--no-torch", action="store_true", help="leave out torch's rows")
    parser.add_argument("--out", default=None, help="also write the markdown tables here")
    parser.add_argument("--parts", default="123",
                        help="which parts to run: 1 packed, 2 paged prefill, 3 paged decode "
                             "(default: 123)")
    parser.add_argument("--sequences", type=int, default=None,
                        help="packed sequences (default 32, --quick 8)")
    parser.add_argument("--min-length", type=int, default=128)
    parser.add_argument("--max-length", type=int, default=None,
                        help="longest drawn length (default 8192, --quick 2048)")
    parser.add_argument("--repetitions", type=int, default=None,
                        help="timed calls per row (default 20, --quick 10)")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.sequences = args.sequences if args.sequences is not None else (8 if args.quick else 32)
    args.max_length = args.max_length if args.max_length is not None else (
        2048 if args.quick else 8192)
    args.repetitions = args.repetitions if args.repetitions is not None else (
        10 if args.quick else 20)
    args.dtypes = tuple(dict.fromkeys(args.dtype)) if args.dtype else (
        ("float16",) if args.quick else DTYPES)
    for name in ("sequences", "min_length", "max_length", "repetitions"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got "
                         f"{getattr(args, name)}")
    if args.min_length > args.max_length:
        parser.error(f"--min-length ({args.min_length}) exceeds --max-length "
                     f"({args.max_length})")
    if not args.parts or set(args.parts) - set("123"):
        parser.error(f"--parts takes digits of 1, 2, 3, got {args.parts!r}")
    return args


class Report:
    """Prints each line as it comes and appends it to `path` (if any), so that a run that
    dies half way still leaves its tables."""

    def __init__(self, path: str | None):
        self.path = path
        if path is not None:
            open(path, "w").close()

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        if self.path is not None:
            with open(self.path, "a") as file:
                file.write(text + "\n")


# --------------------------------------------------------------------------- arrays


def bits_of(x):
    """The 16-bit storage of a float16 / bfloat16 array: copies and gathers run on it, since
    CuPy has no bfloat16 kernels."""
    return x.view(cupy.uint16)


def as_dtype(bits, dtype: str):
    from tileattn.testing import bfloat16

    return bits.view(cupy.float16 if dtype == "float16" else bfloat16())


def random_array(shape: tuple, dtype: str, rng):
    """Unit-normal values in `dtype`, one leading slice at a time (no float32 copy of the
    whole array); bfloat16 rounded to nearest even on the bits."""
    out = cupy.empty(shape, dtype=cupy.uint16)
    for index in range(shape[0]):
        values = rng.standard_normal(shape[1:], dtype=cupy.float32)
        if dtype == "float16":
            out[index] = values.astype(cupy.float16).view(cupy.uint16)
        else:
            bits = values.view(cupy.uint32)
            out[index] = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(cupy.uint16)
    return as_dtype(out, dtype)


def as_float(x, float_type=None):
    """float32 (or `float_type`) copy of a float16 / bfloat16 CuPy array."""
    float_type = float_type or cupy.float32
    if x.dtype.name == "bfloat16":
        return (bits_of(x).astype(cupy.uint32) << 16).view(cupy.float32).astype(float_type)
    return x.astype(float_type)


def max_abs_diff(actual, expected) -> float:
    return float(cupy.abs(as_float(actual) - as_float(expected)).max())


def too_far(diff: float, dtype: str) -> bool:
    """Two results of the same rounding class may each be a tolerance off the exact one
    (unit-normal inputs: |o| <= 1, so atol + rtol bounds one result's error)."""
    from tileattn.testing import TOLERANCES

    tolerance = TOLERANCES[dtype]
    return not diff <= 2 * (tolerance.atol + tolerance.rtol)


def golden_o(q, k, v, causal: bool):
    """float64 o of q (Hg, Nq, D) against one K/V head (Nk, D), causal aligned bottom-right."""
    q64, k64, v64 = (as_float(a, cupy.float64) for a in (q, k, v))
    scores = q64 @ k64.T / math.sqrt(q.shape[-1])
    if causal:
        n_q, n_k = scores.shape[-2:]
        rows = cupy.arange(n_q)[:, None]
        keys = cupy.arange(n_k)[None, :]
        scores = cupy.where(keys <= rows + (n_k - n_q), scores, -cupy.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = cupy.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return probs @ v64


# --------------------------------------------------------------------------- timing


def median_ms(function, repetitions: int, warmup: int = 2) -> float:
    """Median of CUDA-event times, the L2 cache flushed before each call."""
    return median_event_ms(function, repetitions, warmup)


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:160]


# --------------------------------------------------------------------------- 1. packed


@dataclass
class PackedBatch:
    dtype: str
    lengths: np.ndarray      # (S,)
    cu_seqlens: np.ndarray   # (S + 1,) int32
    q: object                # (H, N_total, D), and k, v, do alike
    k: object
    v: object
    do: object

    @property
    def total(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def longest(self) -> int:
        return int(self.lengths.max())

    def span(self, s: int) -> slice:
        return slice(int(self.cu_seqlens[s]), int(self.cu_seqlens[s + 1]))

    def padded(self, packed):
        """(S, H, longest, D), zeros past each sequence's length."""
        out = cupy.zeros((len(self.lengths), packed.shape[0], self.longest, packed.shape[2]),
                         dtype=cupy.uint16)
        for s, n in enumerate(self.lengths):
            out[s, :, :n] = bits_of(packed)[:, self.span(s)]
        return as_dtype(out, self.dtype)

    def packed_from_padded(self, padded):
        """The real rows of a padded (S, H, longest, D) array, packed as (H, N_total, D)."""
        out = cupy.empty((padded.shape[1], self.total, padded.shape[3]), dtype=cupy.uint16)
        for s, n in enumerate(self.lengths):
            out[:, self.span(s)] = bits_of(padded)[s, :, :n]
        return as_dtype(out, self.dtype)


def draw_lengths(args) -> np.ndarray:
    return np.random.default_rng(0).integers(args.min_length, args.max_length + 1,
                                             size=args.sequences)


def make_packed_batch(args, dtype: str) -> PackedBatch:
    lengths = draw_lengths(args)
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    rng = cupy.random.default_rng(0)
    shape = (HEADS, int(cu_seqlens[-1]), HEAD_DIM)
    q, k, v, do = (random_array(shape, dtype, rng) for _ in range(4))
    return PackedBatch(dtype, lengths, cu_seqlens, q, k, v, do)


def kept_pairs(lengths, causal: bool) -> float:
    """FlashAttention's count: sum_s Nq_s * Nk_s, halved when causal."""
    return float(sum(int(n) * int(n) for n in lengths)) / (2 if causal else 1)


def per_sequence_reference(batch: PackedBatch, causal: bool, backward: bool):
    """tileattn dense, one call per sequence, assembled packed: o and (dq, dk, dv) or None."""
    import tileattn

    results = [cupy.empty(batch.q.shape, dtype=cupy.uint16) for _ in range(4 if backward else 1)]
    for s in range(len(batch.lengths)):
        part = [as_dtype(cupy.ascontiguousarray(bits_of(a)[None, :, batch.span(s)]),
                         batch.dtype) for a in (batch.q, batch.k, batch.v, batch.do)]
        o, lse = tileattn.forward(*part[:3], causal=causal, backend="gpu", return_lse=True)
        outputs = [o]
        if backward:
            outputs += list(tileattn.backward(part[3], *part[:3], o, lse, causal=causal,
                                              backend="gpu"))
        for result, output in zip(results, outputs):
            result[:, batch.span(s)] = bits_of(output)[0]
    results = [as_dtype(r, batch.dtype) for r in results]
    return results[0], (tuple(results[1:]) if backward else None)


def check_golden_first_sequence(batch: PackedBatch, causal: bool) -> None:
    """The packed forward against the float64 formula: first sequence, first head."""
    import tileattn
    from tileattn.testing import assert_attention_close

    o = tileattn.forward(batch.q, batch.k, batch.v, causal=causal, backend="gpu",
                         cu_seqlens_q=batch.cu_seqlens, cu_seqlens_k=batch.cu_seqlens)
    first = batch.span(0)
    expected = golden_o(batch.q[:1, first], batch.k[0, first], batch.v[0, first], causal)
    assert_attention_close(as_float(o[:1, first], cupy.float64).get(), expected.get(),
                           batch.q.dtype,
                           name=f"packed o, first sequence ({batch.lengths[0]} tokens)")


def torch_varlen_functions(batch: PackedBatch, causal: bool):
    """(forward, forward_and_backward or None, name), each returning CuPy (H, N_total, D)
    results; raises with the reason where torch has no varlen attention here."""
    if torch is None:
        raise RuntimeError("torch with CUDA is not installed here")
    torch_dtype = torch.float16 if batch.dtype == "float16" else torch.bfloat16

    def to_torch(x):  # (H, T, D) -> (T, H, D), copied once here, outside the timing
        return torch.from_dlpack(x.view(cupy.int16)).view(torch_dtype).transpose(0, 1) \
            .contiguous()

    def to_cupy(t):  # (T, H, D) -> (H, T, D)
        return as_dtype(cupy.from_dlpack(t.transpose(0, 1).contiguous().view(torch.int16))
                        .view(cupy.uint16), batch.dtype)

    tq, tk, tv, tdo = (to_torch(a) for a in (batch.q, batch.k, batch.v, batch.do))
    cu = torch.as_tensor(batch.cu_seqlens, dtype=torch.int32, device="cuda")
    longest = batch.longest
    try:
        from torch.nn.attention import varlen
        parameters = inspect.signature(varlen.varlen_attn).parameters
        if "is_causal" in parameters:
            mask = {"is_causal": causal}
        elif causal:  # newer torch: causal is the window (-1, 0)
            mask = {"window_size": (-1, 0)}
        else:
            mask = {}

        def attend(a, b, c):
            return varlen.varlen_attn(a, b, c, cu, cu, longest, longest, **mask)
        name = "torch varlen_attn"
    except (ImportError, AttributeError):
        flash = torch.ops.aten._flash_attention_forward

        def attend(a, b, c):
            return flash(a, b, c, cu, cu, longest, longest, 0.0, causal, False)[0]
        name = "torch aten flash varlen"

    def forward():
        with torch.no_grad():
            return to_cupy(attend(tq, tk, tv))

    forward()  # raises here where this torch build cannot run it
    if name != "torch varlen_attn":
        return forward, None, name
    gq, gk, gv = (t.detach().requires_grad_() for t in (tq, tk, tv))

    def forward_and_backward():
        grads = torch.autograd.grad(attend(gq, gk, gv), (gq, gk, gv), tdo)
        return tuple(to_cupy(g) for g in grads)
    return forward, forward_and_backward, name


def packed_table(args, report: Report, batch: PackedBatch, first_shape: bool) -> list[str]:
    """Prints the group's rows; returns one line per group on the issue's targets."""
    import tileattn

    one = [a[None] for a in (batch.q, batch.k, batch.v, batch.do)]
    padded = [batch.padded(a) for a in (batch.q, batch.k, batch.v, batch.do)]
    lengths = {"cu_seqlens_q": batch.cu_seqlens, "cu_seqlens_k": batch.cu_seqlens}
    seqlens = np.asarray(batch.lengths, dtype=np.int32)
    padded_lengths = {"seqlens_q": seqlens, "seqlens_k": seqlens}
    passes = ("forward", "fwd+bwd") if args.backward else ("forward",)
    summaries = []
    for causal in (False, True):
        mask = "causal" if causal else "full"
        if first_shape:
            try:
                check_golden_first_sequence(batch, causal)
                # on stderr, so that stdout's table stays one markdown table
                print(f"golden check ({batch.dtype}, {mask}): packed o of the first sequence "
                      "is within tolerance of float64", file=sys.stderr, flush=True)
            except NotImplementedError as error:  # the rows below then say n/a
                print(f"golden check skipped: {first_line(error)}", file=sys.stderr,
                      flush=True)
        reference_o, reference_grads = per_sequence_reference(batch, causal, args.backward)
        work = 4.0 * HEADS * HEAD_DIM * kept_pairs(batch.lengths, causal)
        one_work = 4.0 * HEADS * HEAD_DIM * kept_pairs([batch.total], causal)

        def ours(arrays, keywords, direction):
            def forward():
                return tileattn.forward(*arrays[:3], causal=causal, backend="gpu", **keywords)

            def both():
                o, lse = tileattn.forward(*arrays[:3], causal=causal, backend="gpu",
                                          return_lse=True, **keywords)
                return tileattn.backward(arrays[3], *arrays[:3], o, lse, causal=causal,
                                         backend="gpu", **keywords)
            return forward if direction == "forward" else both

        for direction in passes:
            flops_factor = 1.0 if direction == "forward" else 3.5
            reference = reference_o if direction == "forward" else reference_grads

            def as_packed_results(result, from_padded):
                results = (result,) if direction == "forward" else tuple(result)
                return tuple(batch.packed_from_padded(r) if from_padded else r
                             for r in results)

            rows, unavailable = [], []  # (name, ms or reason, work, diff)
            candidates = [
                ("packed (cu_seqlens)", ours(
                    (batch.q, batch.k, batch.v, batch.do), lengths, direction), work, "packed"),
                ("padded to longest, seqlens", ours(padded, padded_lengths, direction), work,
                 "padded"),
                ("padded to longest, pad and ignore", ours(padded, {}, direction), work,
                 "ignore"),
                ("one dense sequence (B=1, N=total)", ours(one, {}, direction), one_work,
                 None),
            ]
            if not args.no_torch:
                try:
                    forward, both, name = torch_varlen_functions(batch, causal)
                    function = forward if direction == "forward" else both
                    if function is None:
                        unavailable.append((name, "n/a: no autograd on this path", work,
                                            None))
                    else:
                        candidates.append((name, function, work, "packed"))
                except Exception as error:  # any torch build or device that lacks it
                    unavailable.append(("torch varlen", f"n/a: {first_line(error)}", work,
                                        None))
            for name, function, row_work, layout in candidates:
                try:
                    result = function()
                except NotImplementedError as error:
                    rows.append((name, f"n/a: {first_line(error)}", row_work, None))
                    continue
                except Exception as error:
                    traceback.print_exc(file=sys.stderr)
                    rows.append((name, f"failed: {first_line(error)}", row_work, None))
                    continue
                diff = None
                # pad and ignore: padding keys take part unless causal (they then lie after
                # every real row's keys), so only causal results are the packed ones
                if layout in ("packed", "padded") or (layout == "ignore" and causal
                                                       and direction == "forward"):
                    diff = max(max_abs_diff(r, e) for r, e in zip(
                        as_packed_results(result, layout != "packed"),
                        reference if direction != "forward" else (reference,)))
                    if too_far(diff, batch.dtype):
                        rows.append((name, "WRONG: not timed", row_work, diff))
                        continue
                del result
                rows.append((name, median_ms(function, args.repetitions), row_work, diff))
            rows += unavailable
            packed_ms = next((r[1] for r in rows if r[0].startswith("packed")
                              and isinstance(r[1], float)), None)
            one_rate = next((flops_factor * r[2] / r[1] for r in rows
                             if r[0].startswith("one dense") and isinstance(r[1], float)), None)
            for name, ms, row_work, diff in rows:
                diff_cell = "-" if diff is None else f"{diff:.1e}"
                if not isinstance(ms, float):
                    report(f"| {batch.dtype} | {mask} | {direction} | {name} | {ms} | - | - | - "
                           f"| {diff_cell} |")
                    continue
                rate = flops_factor * row_work / ms / 1e9
                versus_packed = f"{ms / packed_ms:.2f}" if packed_ms else "-"
                versus_one = f"{rate / one_rate:.2f}" if one_rate else "-"
                report(f"| {batch.dtype} | {mask} | {direction} | {name} | {ms:.3f} | "
                       f"{rate:.1f} | {versus_packed} | {versus_one} | {diff_cell} |")
            summaries.append(target_summary(f"{batch.dtype} {mask} {direction}", rows,
                                            flops_factor))
            cupy.get_default_memory_pool().free_all_blocks()
            if torch is not None:
                torch.cuda.empty_cache()
    return summaries


def target_summary(label: str, rows: list, flops_factor: float) -> str:
    """The issue's targets for one table group, as measured."""
    times = {name: ms for name, ms, _, _ in rows if isinstance(ms, float)}
    rates = {name: flops_factor * work / ms / 1e9 for name, ms, work, _ in rows
             if isinstance(ms, float)}
    packed = times.get("packed (cu_seqlens)")
    if packed is None:
        return f"- {label}: packed not measured"
    parts = []
    one = rates.get("one dense sequence (B=1, N=total)")
    if one:
        ratio = rates["packed (cu_seqlens)"] / one
        parts.append(f"packed / one-dense rate {ratio:.2f} "
                     f"({'meets' if ratio >= 0.9 else 'misses'} >= 0.9)")
    for name in ("padded to longest, pad and ignore", "padded to longest, seqlens"):
        if name in times:
            parts.append(f"{name} / packed time {times[name] / packed:.2f}x")
    for name, ms in times.items():
        if name.startswith("torch"):
            parts.append(f"{name} / packed time {ms / packed:.2f}x")
    return f"- {label}: " + "; ".join(parts)


def packed_part(args, report: Report) -> None:
    lengths = draw_lengths(args)
    report(f"\n## 1. Packed training batch: {args.sequences} sequences of {lengths.min()}-"
           f"{lengths.max()} tokens (total {lengths.sum()}), H={HEADS}, D={HEAD_DIM}\n")
    report("TFLOP/s: real tokens' kept pairs (one-dense: its own). time / packed > 1: "
           "packed is faster. max abs diff: against tileattn dense run per sequence.\n")
    report("| dtype | mask | pass | layout | median ms | TFLOP/s | time / packed | "
           "rate / one-dense | max abs diff |")
    report("|---|---|---|---|---:|---:|---:|---:|---:|")
    summaries = []
    for index, dtype in enumerate(args.dtypes):
        batch = make_packed_batch(args, dtype)
        summaries += packed_table(args, report, batch, first_shape=index == 0)
        del batch
        cupy.get_default_memory_pool().free_all_blocks()
    report("\nTargets, as measured:\n")
    for line in summaries:
        report(line)


# --------------------------------------------------------------------------- 2./3. paged


def paged_prefill_part(args, report: Report, dtype: str) -> None:
    import tileattn
    from tileattn.testing import assert_attention_close

    batch, n_new, n_cached, page_size = 4, 512, 8192, 64
    if args.quick:
        n_cached = 2048
    n_keys = n_cached + n_new
    report(f"\n## 2. Paged prefill/append: B={batch}, Nq={n_new} new tokens onto {n_cached} "
           f"cached keys (Nk={n_keys}), causal bottom-right, page size {page_size}, "
           f"D={HEAD_DIM}, {dtype}\n")
    report("Single calls after an L2 flush (the host's time past the flush counted), and "
           "calls back to back (the host's time overlapped, as a server queues its steps).\n")
    report("| Hq/Hkv | contiguous ms | paged ms | contiguous / paged | paged TFLOP/s | "
           "back to back: contiguous ms | paged ms | contiguous / paged | max abs diff |")
    report("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    pairs = n_new * (n_keys - n_new) + n_new * (n_new + 1) / 2
    for n_q_heads, n_kv_heads in ((16, 16), (32, 8)):
        rng = cupy.random.default_rng(2)
        q = random_array((batch, n_q_heads, n_new, HEAD_DIM), dtype, rng)
        k = random_array((batch, n_kv_heads, n_keys, HEAD_DIM), dtype, rng)
        v = random_array((batch, n_kv_heads, n_keys, HEAD_DIM), dtype, rng)
        seqlens_k = cupy.full(batch, n_keys, dtype=cupy.int32)
        k_pool, table = page_pool(k, [n_keys] * batch, page_size, np.random.default_rng(3))
        v_pool, _ = page_pool(v, [n_keys] * batch, page_size, np.random.default_rng(3))

        def contiguous():
            return tileattn.forward(q, k, v, causal=True, backend="gpu")

        def paged(check=False):
            return tileattn.forward(q, k_pool, v_pool, causal=True, backend="gpu",
                                    block_table=table, seqlens_k=seqlens_k,
                                    check_lengths=check)
        name = f"{n_q_heads}/{n_kv_heads}"
        try:
            paged_o = paged(check=True)
        except Exception as error:
            report(f"| {name} | - | {'n/a' if isinstance(error, NotImplementedError) else 'failed'}"
                   f": {first_line(error)} | - | - | - | - | - | - |")
            continue
        group = n_q_heads // n_kv_heads
        assert_attention_close(as_float(paged_o[0, :group], cupy.float64).get(),
                               golden_o(q[0, :group], k[0, 0], v[0, 0], True).get(),
                               q.dtype, name=f"paged prefill o {name}")
        diff = max_abs_diff(paged_o, contiguous())
        if too_far(diff, dtype):
            report(f"| {name} | - | WRONG: not timed | - | - | - | - | - | {diff:.1e} |")
            continue
        contiguous_ms = median_ms(contiguous, args.repetitions)
        paged_ms = median_ms(paged, args.repetitions)
        rate = 4.0 * batch * n_q_heads * HEAD_DIM * pairs / paged_ms / 1e9
        queued = [back_to_back_ms(f, args.repetitions) for f in (contiguous, paged)]
        report(f"| {name} | {contiguous_ms:.3f} | {paged_ms:.3f} | "
               f"{contiguous_ms / paged_ms:.2f} | {rate:.1f} | {queued[0]:.3f} | "
               f"{queued[1]:.3f} | {queued[0] / queued[1]:.2f} | {diff:.1e} |")
        cupy.get_default_memory_pool().free_all_blocks()


def paged_decode_part(args, report: Report, dtype: str) -> None:
    import tileattn
    from tileattn.testing import assert_attention_close

    batch, n_q_heads, n_kv_heads = 8, 32, 8
    longest_drawn = 2048 if args.quick else 8192
    lengths = np.random.default_rng(4).integers(1024, longest_drawn + 1, size=batch)
    capacity = -(-int(lengths.max()) // 256) * 256  # a multiple of every page size
    rng = cupy.random.default_rng(5)
    q = random_array((batch, n_q_heads, 1, HEAD_DIM), dtype, rng)
    k = random_array((batch, n_kv_heads, capacity, HEAD_DIM), dtype, rng)
    v = random_array((batch, n_kv_heads, capacity, HEAD_DIM), dtype, rng)
    seqlens_k = cupy.asarray(lengths, dtype=cupy.int32)
    kv_bytes = 2 * n_kv_heads * HEAD_DIM * 2 * int(lengths.sum())
    report(f"\n## 3. Paged decode: B={batch}, Nq=1, Hq={n_q_heads}, Hkv={n_kv_heads}, "
           f"D={HEAD_DIM}, {dtype}, keys per sequence {', '.join(map(str, lengths))} "
           f"(K+V {kv_bytes / 2**20:.0f} MiB)\n")

    def contiguous(check=False):
        return tileattn.forward(q, k, v, backend="gpu", seqlens_k=seqlens_k,
                                check_lengths=check)
    contiguous_o = contiguous(check=True)
    group = n_q_heads // n_kv_heads
    first = int(lengths[0])
    assert_attention_close(as_float(contiguous_o[0, :group], cupy.float64).get(),
                           golden_o(q[0, :group], k[0, 0, :first], v[0, 0, :first],
                                    False).get(),
                           q.dtype, name="contiguous decode o")
    contiguous_us = 1e3 * median_ms(contiguous, args.repetitions)
    # Back to back (FlashAttention's method), calls queue behind the kernels, so their host
    # time (~70-110 us for these calls, as long as the kernels) drops out of the time.
    contiguous_queued = 1e3 * back_to_back_ms(contiguous, args.repetitions)
    report("| layout | page size | median us | K+V GB/s | contiguous / paged | back to back us "
           "| contiguous / paged, back to back | max abs diff |")
    report("|---|---:|---:|---:|---:|---:|---:|---:|")
    report(f"| contiguous (seqlens_k) | - | {contiguous_us:.1f} | "
           f"{kv_bytes / contiguous_us / 1e3:.0f} | 1.00 | {contiguous_queued:.1f} | 1.00 | "
           "golden ok |")
    for page_size in (1, 16, 64, 256):
        k_pool, table = page_pool(k, lengths, page_size, np.random.default_rng(6))
        v_pool, _ = page_pool(v, lengths, page_size, np.random.default_rng(6))

        def paged(check=False):
            return tileattn.forward(q, k_pool, v_pool, backend="gpu", block_table=table,
                                    seqlens_k=seqlens_k, check_lengths=check)
        try:
            diff = max_abs_diff(paged(check=True), contiguous_o)
        except Exception as error:
            report(f"| paged | {page_size} | {first_line(error)} | - | - | - | - | - |")
            continue
        if too_far(diff, dtype):
            report(f"| paged | {page_size} | WRONG: not timed | - | - | - | - | {diff:.1e} |")
            continue
        paged_us = 1e3 * median_ms(paged, args.repetitions)
        paged_queued = 1e3 * back_to_back_ms(paged, args.repetitions)
        report(f"| paged | {page_size} | {paged_us:.1f} | {kv_bytes / paged_us / 1e3:.0f} | "
               f"{contiguous_us / paged_us:.2f} | {paged_queued:.1f} | "
               f"{contiguous_queued / paged_queued:.2f} | {diff:.1e} |")
        cupy.get_default_memory_pool().free_all_blocks()


# --------------------------------------------------------------------------- main


def main(argv=None) -> None:
    global cupy, torch
    args = parse_args(argv)
    import cupy as cupy_module

    cupy = cupy_module
    if not args.no_torch:
        try:
            import torch as torch_module
            torch = torch_module
        except ImportError:
            torch = None
    cupy.cuda.Device(0).use()
    if torch is not None:
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        else:  # a CPU-only torch build: its rows say n/a
            torch = None
    report = Report(args.out)
    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    report(f"# tileattn variable-length and paged attention, {name}\n")
    report(f"CuPy {cupy.__version__}, torch {torch.__version__ if torch else 'absent'}; "
           f"median of {args.repetitions}, L2 flushed; dtypes {', '.join(args.dtypes)}"
           f"{'; --quick' if args.quick else ''}")
    if "1" in args.parts:
        packed_part(args, report)
    if "2" in args.parts:
        paged_prefill_part(args, report, args.dtypes[0])
    if "3" in args.parts:
        paged_decode_part(args, report, args.dtypes[0])


if __name__ == "__main__":
    main()
