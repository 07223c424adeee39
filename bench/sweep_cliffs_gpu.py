"""Shapes and options the other GPU benchmarks leave out, each against an anchor: a search
for cliffs (a call far slower than it should be), not a scoreboard.

    PYTHONPATH=. python3 bench/sweep_cliffs_gpu.py                 # every case
    PYTHONPATH=. python3 bench/sweep_cliffs_gpu.py --only "D 1" --dtypes bfloat16
    PYTHONPATH=. python3 bench/sweep_cliffs_gpu.py --quick         # small sizes

Each case is first checked against the golden model on a small problem of the same kind
(forward and gradients, the dtype's tolerance), then timed forward and forward + backward,
calls queued back to back (FlashAttention's method: host time counts where it exceeds the
kernels'). The anchor is the fastest torch SDPA backend (flash, efficient, cuDNN) that runs
the case where torch is installed and has its options (causal bottom-right through torch's
`causal_lower_right`, GQA, dropout), or torch's math backend where none of those does
(float64: `--dtypes float64`); for softcap, ALiBi and windows, tileattn's own call of
the same shape without the option, so the column says what the option costs. A row is
marked CLIFF when tileattn is under 0.8x torch, or when an option costs over 1.5x the
plain call (the CPU sweep's thresholds). On the H100 the fastest torch backend is mostly
cuDNN's; the flash column is FlashAttention-2, the issues' yardstick.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

import numpy as np

TORCH_OPTIONS = {"causal", "dropout_p", "seed", "layout"}


@dataclass
class Case:
    name: str
    batch: int
    heads: int
    kv_heads: int
    n_q: int
    n_k: int
    head_dim: int
    dtype: str = "float16"
    dv: int = 0
    options: dict = field(default_factory=dict)

    @property
    def value_dim(self) -> int:
        return self.dv or self.head_dim

    @property
    def torch_can(self) -> bool:
        return set(self.options) <= TORCH_OPTIONS

    @property
    def bshd(self) -> bool:
        return self.options.get("layout") == "bshd"

    def shapes(self, scale_down: int = 1):
        n_q, n_k = max(1, self.n_q // scale_down), max(1, self.n_k // scale_down)
        batch = max(1, self.batch // scale_down)
        heads, kv_heads = self.heads, self.kv_heads
        if scale_down > 1 and heads > 4:  # keep the group size, fewer groups
            kv_heads = max(1, kv_heads * 4 // heads)
            heads = kv_heads * (self.heads // self.kv_heads)
        dims = (self.head_dim, self.head_dim, self.value_dim, self.value_dim)
        rows = (n_q, n_k, n_k, n_q)
        counts = (heads, kv_heads, kv_heads, heads)
        if self.bshd:
            return [(batch, r, h, d) for r, h, d in zip(rows, counts, dims)]
        return [(batch, h, r, d) for r, h, d in zip(rows, counts, dims)]

    def call_options(self, scale_down: int = 1) -> dict:
        """The options, ALiBi's "per head" made one slope per query head of the arrays."""
        options = dict(self.options)
        if options.get("alibi_slopes") == "per head":
            heads = self.shapes(scale_down)[0][2 if self.bshd else 1]
            options["alibi_slopes"] = np.linspace(0.05, 0.5, heads).astype(np.float32)
        return options

    def host_arrays(self, scale_down: int = 1, seed: int = 0):
        from tileattn.testing import bfloat16

        rng = np.random.default_rng(seed)
        dtype = bfloat16() if self.dtype == "bfloat16" else np.dtype(self.dtype)
        return [rng.standard_normal(s, dtype=np.float32).astype(dtype)
                for s in self.shapes(scale_down)]

    def flops(self, backward: bool) -> float:
        """FlashAttention's count: 2*B*H*Nq*Nk*(D + Dv), halved when causal; a backward is
        2.5 forwards."""
        flops = 2.0 * self.batch * self.heads * self.n_q * self.n_k * (
            self.head_dim + self.value_dim)
        if self.options.get("causal"):
            flops /= 2
        return flops * (3.5 if backward else 1.0)


def cases(quick: bool, dtypes) -> list:
    n = 512 if quick else 4096
    keys = 1024 if quick else 8192
    long = 4096 if quick else 65536
    tokens = 2048 if quick else 16384
    causal = {"causal": True}
    listed = []
    for dtype in dtypes:
        def add(name, *shape, dv=0, options=causal):
            listed.append(Case(f"{name}", *shape, dtype=dtype, dv=dv, options=dict(options)))

        for d in (8, 16, 24, 40, 72, 80, 96, 100, 112, 160, 192, 256, 320):
            add(f"D {d}", tokens // n, max(1, 2048 // d), max(1, 2048 // d), n, n, d)
        add("MLA decode D 576 Dv 512", 8, 16, 1, 1, keys, 576, dv=512, options={})
        add("MLA decode 128 heads", 2, 128, 1, 1, keys, 576, dv=512, options={})
        add("MLA decode 2 rows (multi-token prediction)", 2, 128, 1, 2, keys, 576, dv=512)
        add("D 192 Dv 128", tokens // n, 16, 16, n, n, 192, dv=128)
        add("D 128 Dv 64", tokens // n, 16, 16, n, n, 128, dv=64)
        add("D 64 Dv 128", tokens // n, 16, 16, n, n, 64, dv=128)
        add("plain", tokens // n, 16, 16, n, n, 128, options={})
        add("bshd layout", tokens // n, 16, 16, n, n, 128,
            options={"causal": True, "layout": "bshd"})
        add("Nq 17 over keys", 4, 32, 8, 17, keys, 128)
        add("Nq 100 over keys", 4, 16, 16, 100, keys, 128)
        add("chunk 512 of keys", 1, 32, 8, 512, keys, 128)
        add("MHA Nq 128 over long keys", 1, 32, 32, 128, 4 * keys, 128)
        add("MHA chunk 256 of keys", 1, 16, 16, 256, keys, 128)
        # Decode steps: the split-KV kernels (tensor cores for 16-bit, CUDA cores for
        # float32 and for ALiBi), one query row or a speculative few, over long caches.
        add("decode GQA 32/8", 8, 32, 8, 1, 4 * keys, 128, options={})
        add("decode MHA B 1", 1, 32, 32, 1, long, 128, options={})
        add("decode MQA 8/1", 1, 8, 1, 1, 2 * long, 128, options={})
        add("decode D 64 B 64", 64, 32, 8, 1, keys // 2, 64, options={})
        add("decode softcap", 8, 32, 8, 1, 4 * keys, 128, options={"softcap": 30.0})
        add("decode ALiBi", 8, 32, 8, 1, 4 * keys, 128, options={"alibi_slopes": "per head"})
        add("speculative Nq 8", 8, 32, 8, 8, 4 * keys, 128)
        # The first steps of a generation: caches shorter than tiles.DECODE_MIN_KEYS (the
        # prefill runs them, a 64-row tile and a K/V read per query head) at large batches.
        add("decode short cache GQA 32/8", 256, 32, 8, 1, 200, 128, options={})
        add("decode short cache MHA", 128, 32, 32, 1, 160, 128, options={})
        add("keys 100 under Nq", 4, 16, 16, n, 100, 128, options={})
        add("B 256 of N 64", 256, 16, 16, 64, 64, 64)
        add("B 1024 of N 128", 1024, 8, 8, 128, 128, 128)
        # Encoders' short, odd sequence lengths at large batches (no mask): ViT-B/16 at
        # 224 px (197 tokens, 12 heads of 64), Swin-T's first stage (windows of 7 x 7 tokens,
        # 3 heads of 32, 64 windows of 64 images), ViT-H/14 (257 tokens, 16 heads of 80), BERT-base
        # (512 tokens), Whisper's encoder (1500 frames, 20 heads of 64).
        add("ViT-B N 197", 256, 12, 12, 197, 197, 64, options={})
        add("Swin window N 49 D 32", 4096, 3, 3, 49, 49, 32, options={})
        add("ViT-H N 257 D 80", 64, 16, 16, 257, 257, 80, options={})
        add("BERT N 512", 64, 12, 12, 512, 512, 64, options={})
        add("Whisper N 1500", 8, 20, 20, 1500, 1500, 64, options={})
        # Stable Diffusion 1.5's cross-attention: latent pixels over 77 text tokens, 8 heads of
        # 40 / 80 / 160 at the U-Net's three resolutions (batch 2 x 4 images).
        for d, pixels in ((40, 4096), (80, 1024), (160, 256)):
            add(f"SD cross-attn D {d}", 8, 8, 8, pixels, 77, d, options={})
        # Head counts that are not powers of two: GQA groups of 7 (Qwen2-7B's 28/4), MQA over
        # 71 heads (Falcon-7B), prefill and decode.
        add("odd heads GQA 28/4", tokens // n, 28, 4, n, n, 128)
        add("odd heads MQA 71/1", tokens // n, 71, 1, n, n, 64)
        add("odd heads decode 28/4", 8, 28, 4, 1, 4 * keys, 128, options={})
        add("odd heads decode 71/1", 8, 71, 1, 1, 4 * keys, 64, options={})
        add("one long head", 1, 1, 1, long, long, 128)
        add("B 1 long 16 heads", 1, 16, 16, long // 4, long // 4, 128)
        add("GQA 32/4", tokens // n, 32, 4, n, n, 128)
        add("MQA 16/1", tokens // n, 16, 1, n, n, 64)
        add("softcap", tokens // n, 16, 16, n, n, 128, options={"softcap": 30.0})
        add("causal softcap", tokens // n, 16, 16, n, n, 128,
            options={"causal": True, "softcap": 30.0})
        add("ALiBi", tokens // n, 16, 16, n, n, 128, options={"alibi_slopes": "per head"})
        add("causal ALiBi", tokens // n, 16, 16, n, n, 128,
            options={"causal": True, "alibi_slopes": "per head"})
        add("window 256", tokens // n, 16, 16, n, n, 128, options={"window": (256, 0)})
        add("dropout", tokens // n, 16, 16, n, n, 128,
            options={"dropout_p": 0.1, "seed": 3})
        add("causal dropout", tokens // n, 16, 16, n, n, 128,
            options={"causal": True, "dropout_p": 0.1, "seed": 3})
        add("dropout D 64", tokens // n, 32, 32, n, n, 64,
            options={"dropout_p": 0.1, "seed": 3})
    return listed


def device_arrays(host):
    import cupy

    moved = []
    for array in host:
        if array.dtype.name == "bfloat16":
            moved.append(cupy.asarray(array.view(np.uint16)).view(array.dtype))
        else:
            moved.append(cupy.asarray(array))
    return moved


def check(case: Case) -> float:
    """Worst error of o, dq, dk, dv on a small problem of the case's kind, in multiples of
    the dtype's tolerance, against the golden model on the same (rounded) inputs."""
    import tileattn
    from tileattn.testing import attention_error

    host = case.host_arrays(scale_down=8, seed=1)
    q, k, v, do = device_arrays(host)
    options = case.call_options(scale_down=8)
    o, lse = tileattn.forward(q, k, v, return_lse=True, backend="gpu", **options)
    grads = tileattn.backward(do, q, k, v, o, lse, backend="gpu", **options)
    wide = [a.astype(np.float64) for a in host]
    o64, lse64 = tileattn.forward(*wide[:3], return_lse=True, backend="reference", **options)
    grads64 = tileattn.backward(wide[3], *wide[:3], o.get().astype(np.float64), lse64,
                                backend="reference", **options)
    return max(attention_error(got.get(), want, host[0].dtype)
               for got, want in zip((o, *grads), (o64, *grads64)))


def tileattn_calls(options: dict, arrays):
    from attention_calls import tileattn_calls as calls  # bench/ is on the path when run

    return calls(options, arrays, "gpu")


def torch_calls(case: Case, arrays):
    """(backend name, forward, forward + backward) for each fused torch SDPA backend that runs
    the case, forward and backward; where none does (float64, say), torch's math backend,
    what a torch user gets there (it holds the B x H x Nq x Nk scores in memory)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    from bench_gpu import _as_torch

    tensors = [_as_torch(a) for a in arrays]
    if case.bshd:  # torch takes (B, H, S, D): the same memory, viewed
        tensors = [t.transpose(1, 2) for t in tensors]
    q, k, v, do = tensors
    causal = case.options.get("causal", False)
    mask = causal_lower_right(case.n_q, case.n_k) if causal and case.n_q != case.n_k else None
    keywords = dict(attn_mask=mask, is_causal=causal and mask is None,
                    dropout_p=case.options.get("dropout_p", 0.0),
                    enable_gqa=case.heads != case.kv_heads)

    def attention(backend, grad):
        operands = [t.detach().requires_grad_(grad) for t in (q, k, v)]
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(*operands, **keywords)

    found = []
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("math", SDPBackend.MATH)):
        if name == "math" and found:
            break
        try:
            attention(backend, True).backward(do)
        except RuntimeError:
            continue

        def forward(backend=backend):
            with torch.no_grad():
                attention(backend, False)

        def forward_backward(backend=backend):
            attention(backend, True).backward(do)

        found.append((name, forward, forward_backward))
    return found


def per_call_ms(function, budget_ms: float = 60.0) -> float:
    """Milliseconds per call, calls queued back to back, enough of them for `budget_ms`."""
    import cupy

    from gpu_timing import back_to_back_ms

    function()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    function()
    stop.record()
    stop.synchronize()
    once = max(cupy.cuda.get_elapsed_time(start, stop), 1e-3)
    repetitions = int(min(200, max(3, budget_ms / once)))
    return back_to_back_ms(function, repetitions, warmup=1, rounds=3)


def refusal(case: Case) -> str | None:
    """Why the GPU does not serve the case (a head dim whose CUDA-core tiles outgrow shared
    memory, float64 at 576/512 say: the README lists them), or None."""
    from tileattn import gpu
    from tileattn.options import AttentionOptions

    lines = gpu.describe(case.n_k, case.head_dim, case.value_dim, case.dtype,
                         AttentionOptions(), n_q=case.n_q, heads=case.heads,
                         kv_heads=case.kv_heads, batch=case.batch)
    refused = [line for line in lines.values() if "not served" in line]
    return refused[0] if refused else None


def warm(case: Case) -> None:
    """Compiles what a case's check and timing need (a worker of `precompile`)."""
    import cupy

    if refusal(case) is not None:
        return
    check(case)
    arrays = device_arrays(case.host_arrays())
    for calls in (tileattn_calls(case.call_options(), arrays),
                  tileattn_calls(plain_options(case), arrays)):
        calls[1]()
    cupy.cuda.Device().synchronize()


def precompile(listed: list, workers: int) -> None:
    """Compiles every case's kernels in `workers` processes, so that the timed process
    loads them from the disk caches instead of compiling one case after another."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        pool.map(warm, listed)


def plain_options(case: Case) -> dict:
    """The case's options less the one under test (the anchor of an option torch lacks)."""
    return {key: value for key, value in case.options.items() if key in ("causal", "layout")}


def torch_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def run(args) -> int:
    try:
        import cupy
    except ImportError:
        print("sweep_cliffs_gpu.py: error: needs CuPy and a GPU: pip install 'tileattn[gpu]'",
              file=sys.stderr)
        return 2

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from attention_calls import NO_OPTION, is_cliff

    have_torch = torch_available() and not args.no_torch
    print(f"# tileattn GPU ({cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}), "
          f"calls back to back; anchor: the fastest torch SDPA backend where it has the "
          f"options{'' if have_torch else ' (absent)'}, else the same call without the option")
    print("| case | dtype | shape (B, Hq/Hkv, Nq, Nk, D/Dv) | check | pass | tileattn ms | "
          "TFLOP/s | anchor | anchor ms | anchor / tileattn | flash / tileattn | |")
    print("|---|---|---|---|---|---:|---:|---|---:|---:|---:|---|")
    failures = cliffs = 0
    listed = [case for case in cases(args.quick, args.dtypes)
              if any(part.lower() in case.name.lower() for part in args.only)]
    if args.workers > 1:
        precompile(listed, args.workers)
    for case in listed:
        reason = refusal(case)
        if reason is not None:
            print(f"| {case.name} | {case.dtype} | - | - | - | {reason} |", flush=True)
            continue
        error = check(case)
        failures += not error <= 1.0
        arrays = device_arrays(case.host_arrays())
        ours = tileattn_calls(case.call_options(), arrays)
        anchors = []
        if case.torch_can and have_torch:
            anchors = torch_calls(case, arrays)
        elif not case.torch_can:
            anchors = [(NO_OPTION, *tileattn_calls(plain_options(case), arrays))]
        shape = (f"{case.batch}, {case.heads}/{case.kv_heads}, {case.n_q}, {case.n_k}, "
                 f"{case.head_dim}/{case.value_dim}")
        for index, name in enumerate(("fwd", "fwd+bwd")):
            mine = per_call_ms(ours[index])
            timed = [(label, per_call_ms(calls[index])) for label, *calls in anchors]
            label, anchor_ms = min(timed, key=lambda pair: pair[1]) if timed else ("-", None)
            ratio = anchor_ms / mine if anchor_ms else float("nan")
            flash = dict(timed).get("flash", float("nan")) / mine
            cliff = is_cliff(label, ratio)
            cliffs += cliff
            rate = case.flops(index == 1) / mine / 1e9
            anchor_text = "-" if anchor_ms is None else f"{anchor_ms:.3f}"
            print(f"| {case.name} | {case.dtype} | {shape} | {error:.2g}x | {name} | "
                  f"{mine:.3f} | {rate:.0f} | {label} | {anchor_text} | {ratio:.2f} | "
                  f"{flash:.2f} | {'CLIFF' if cliff else ''} |", flush=True)
    print(f"{cliffs} cliffs; {failures} cases outside their dtype's tolerance")
    return 1 if failures else 0


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--only", nargs="+", default=[""],
                        help="cases whose name contains one of these")
    parser.add_argument("--dtypes", nargs="+", default=["float16"],
                        choices=["float16", "bfloat16", "float32", "float64"])
    parser.add_argument("--no-torch", action="store_true",
                        help="leave torch out even where installed")
    parser.add_argument("--workers", type=int, default=12,
                        help="processes compiling the kernels first (1: none)")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    return args


if __name__ == "__main__":
    sys.exit(run(parse()))
