"""Shapes and options the other CPU benchmarks leave out, each against an anchor: a search
for cliffs (a call far slower than it should be), not a scoreboard.

    PYTHONPATH=. python bench/sweep_cliffs_cpu.py              # every case, 2 passes
    PYTHONPATH=. python bench/sweep_cliffs_cpu.py --only softcap --rounds 5
    PYTHONPATH=. python bench/sweep_cliffs_cpu.py --quick      # small sizes, seconds

Each case is first checked against the golden model on a small problem of the same kind,
then timed forward and forward + backward (median of `--rounds`, tileattn and the anchor
taking turns, each call after a `--pause`: torch's OpenMP threads spin for a while after a
call and take the core a following call's second thread needs; back to back, tileattn's
N = 256-512 calls looked 0.4-0.5x torch with no speed-up from a second thread). The anchor is torch SDPA at the same thread count where it has the case's
options (causal and GQA; bottom-right causal through an explicit mask) and torch is
installed; otherwise, and for softcap, ALiBi, dropout and windows, tileattn's own call of
the same shape without the option, so the column says what the option costs. A row is
marked CLIFF when tileattn is under 0.8x torch, or when an option costs over 1.5x the
plain call (bench/NOTES-cpu.md, session 10: softcap cost 4.8x, ALiBi 2x, before the fix).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field

import numba
import numpy as np

import attention_calls
import tileattn
from tileattn.testing import attention_error

@dataclass
class Case:
    name: str
    batch: int
    heads: int
    kv_heads: int
    n_q: int
    n_k: int
    head_dim: int
    options: dict = field(default_factory=dict)

    @property
    def torch_can(self) -> bool:
        return set(self.options) <= {"causal"}

    def arrays(self, scale_down: int = 1, seed: int = 0):
        rng = np.random.default_rng(seed)
        n_q, n_k = max(1, self.n_q // scale_down), max(1, self.n_k // scale_down)
        shapes = ((self.batch, self.heads, n_q, self.head_dim),
                  (self.batch, self.kv_heads, n_k, self.head_dim),
                  (self.batch, self.kv_heads, n_k, self.head_dim),
                  (self.batch, self.heads, n_q, self.head_dim))
        return [rng.standard_normal(shape).astype(np.float32) for shape in shapes]


def cases(quick: bool) -> list:
    n = 256 if quick else 2048
    long = 1024 if quick else 16384
    keys = 512 if quick else 4096
    slopes = np.linspace(0.1, 1.0, 8).astype(np.float32)
    causal = {"causal": True}
    listed = [Case(f"D {d}", 1, 8, 8, n, n, d, causal) for d in (8, 16, 24, 40, 72, 100)]
    listed += [
        Case("Nq 100 over keys", 1, 8, 8, 100, keys, 64, causal),
        Case("keys 100 under Nq", 1, 8, 8, keys, 100, 64, causal),
        Case("Nq 17", 1, 8, 8, 17, keys, 128, causal),
        Case("Nq 33", 1, 8, 8, 33, keys, 128, causal),
        Case("B 256 of N 64", 256, 4, 4, 64, 64, 64, causal),
        # Encoders' short, odd lengths, no mask (the GPU sweep's cases at CPU batch sizes)
        Case("encoder ViT-B N 197", 8, 12, 12, 197, 197, 64),
        Case("encoder ViT-H N 257 D 80", 4, 16, 16, 257, 257, 80),
        Case("encoder BERT N 512", 4, 12, 12, 512, 512, 64),
        Case("encoder Whisper N 1500", 1, 20, 20, 1500, 1500, 64),
        # Stable Diffusion 1.5's cross-attention: latent pixels over 77 text tokens, 8 heads
        # of 40 / 80 / 160 at the U-Net's three resolutions (one image).
        Case("SD cross-attn D 40", 1, 8, 8, 4096, 77, 40),
        Case("SD cross-attn D 80", 1, 8, 8, 1024, 77, 80),
        Case("SD cross-attn D 160", 1, 8, 8, 256, 77, 160),
        # Head counts that are not powers of two: GQA groups of 7 (Qwen2-7B's 28/4), MQA
        # over 71 heads (Falcon-7B), and their decode steps.
        Case("odd heads GQA 28/4", 1, 28, 4, n // 2, n // 2, 128, causal),
        Case("odd heads MQA 71/1", 1, 71, 1, n // 4, n // 4, 64, causal),
        Case("odd heads decode 28/4", 4, 28, 4, 1, keys, 128),
        Case("odd heads decode 71/1", 4, 71, 1, 1, keys, 64),
        Case("one long head", 1, 1, 1, long, long, 64, causal),
        Case("GQA 32/4", 1, 32, 4, n, n, 128, causal),
        Case("plain", 1, 8, 8, n, n, 64),
        Case("softcap", 1, 8, 8, n, n, 64, {"softcap": 30.0}),
        Case("ALiBi", 1, 8, 8, n, n, 64, {"alibi_slopes": slopes}),
        Case("dropout", 1, 8, 8, n, n, 64, {"dropout_p": 0.1, "seed": 1}),
        Case("window", 1, 8, 8, n, n, 64, {"window": (256, 0)}),
        Case("causal softcap", 1, 8, 8, n, n, 64, {"causal": True, "softcap": 30.0}),
    ]
    return listed


def check(case: Case) -> float:
    """Worst error of forward and gradients on a small problem of the case's kind, in
    multiples of the float32 tolerance."""
    q, k, v, do = case.arrays(scale_down=8, seed=1)
    o, lse = tileattn.forward(q, k, v, return_lse=True, backend="cpu", **case.options)
    grads = tileattn.backward(do, q, k, v, o, lse, backend="cpu", **case.options)
    wide = [a.astype(np.float64) for a in (q, k, v, do)]
    o64, lse64 = tileattn.forward(*wide[:3], return_lse=True, backend="reference",
                                  **case.options)
    grads64 = tileattn.backward(wide[3], *wide[:3], o.astype(np.float64), lse64,
                                backend="reference", **case.options)
    return max(attention_error(got, want, np.float32)
               for got, want in zip((o, lse, *grads), (o64, lse64, *grads64)))


def torch_calls(case: Case, arrays):
    import torch

    q, k, v, do = (torch.from_numpy(a) for a in arrays)
    mask = None
    causal = case.options.get("causal", False)
    if causal and case.n_q != case.n_k:  # torch's is_causal is top-left: pass bottom-right
        mask = (torch.arange(case.n_k)[None, :]
                <= torch.arange(case.n_q)[:, None] + (case.n_k - case.n_q))
    gqa = case.heads != case.kv_heads

    def attention(grad):
        operands = [x.detach().requires_grad_(grad) for x in (q, k, v)]
        return torch.nn.functional.scaled_dot_product_attention(
            *operands, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=gqa)

    def forward():
        with torch.no_grad():
            attention(False)

    def forward_backward():
        attention(True).backward(do)

    return forward, forward_backward


def median_times(functions, rounds: int, pause: float) -> list:
    """Median seconds of each function, the functions taking turns, `pause` s before each."""
    for function in functions:
        function()
    times = [[] for _ in functions]
    for _ in range(rounds):
        for index, function in enumerate(functions):
            time.sleep(pause)
            start = time.perf_counter()
            function()
            times[index].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def run(args) -> int:
    have_torch = torch_available() and not args.no_torch
    if have_torch:
        import torch

        torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    print(f"# tileattn CPU, float32, {args.threads} threads, median of {args.rounds}; "
          f"anchor: torch SDPA where it has the options{'' if have_torch else ' (absent)'},"
          f" else the same call without the option")
    print("| case | shape (B, Hq/Hkv, Nq, Nk, D) | check | pass | tileattn ms | anchor | "
          "anchor ms | anchor / tileattn | |")
    print("|---|---|---|---|---:|---|---:|---:|---|")
    failures = cliffs = 0
    for case in cases(args.quick):
        if args.only and args.only.lower() not in case.name.lower():
            continue
        error = check(case)
        failures += not error <= 1.0
        arrays = case.arrays()
        ours = attention_calls.tileattn_calls(case.options, arrays, "cpu")
        if case.torch_can and have_torch:
            anchor_name, anchor = "torch", torch_calls(case, arrays)
        elif case.torch_can:
            anchor_name, anchor = None, None
        else:
            plain = {"causal": True} if case.options.get("causal") else {}
            anchor_name = attention_calls.NO_OPTION
            anchor = attention_calls.tileattn_calls(plain, arrays, "cpu")
        shape = (f"{case.batch}, {case.heads}/{case.kv_heads}, {case.n_q}, {case.n_k}, "
                 f"{case.head_dim}")
        for index, name in enumerate(("fwd", "fwd+bwd")):
            functions = [ours[index]] + ([anchor[index]] if anchor else [])
            times = median_times(functions, args.rounds, args.pause)
            ratio = times[1] / times[0] if anchor else float("nan")
            cliff = attention_calls.is_cliff(anchor_name, ratio)
            cliffs += cliff
            anchor_ms = f"{times[1] * 1e3:.2f}" if anchor else "-"
            print(f"| {case.name} | {shape} | {error:.2g}x | {name} | {times[0] * 1e3:.2f} | "
                  f"{anchor_name or '-'} | {anchor_ms} | {ratio:.2f} | "
                  f"{'CLIFF' if cliff else ''} |", flush=True)
    print(f"{cliffs} cliffs; {failures} cases outside the float32 tolerance")
    return 1 if failures else 0


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--only", default="", help="cases whose name contains this")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    parser.add_argument("--pause", type=float, default=0.2,
                        help="seconds of quiet before each timed call")
    parser.add_argument("--no-torch", action="store_true",
                        help="leave torch out even where installed")
    args = parser.parse_args(argv)
    if args.pause < 0:
        parser.error(f"--pause must be 0 or more, got {args.pause}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if not 1 <= args.threads <= numba.config.NUMBA_NUM_THREADS:
        parser.error(f"--threads must be 1..{numba.config.NUMBA_NUM_THREADS}, "
                     f"got {args.threads}")
    return args


if __name__ == "__main__":
    sys.exit(run(parse()))
