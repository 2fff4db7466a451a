"""Decode attention over shared prefixes: the compiled CPU kernel alone, as a decode step calls it.

Sits beside benchmarks/engine_steps.py (whole steps); this isolates `cpu_ops.paged_attention`
for a batch of decode tokens whose sequences share cached prefix pages, the shape of
vs_vllm.py's `prefix` workload (8 shared 1,024-token prefixes, a private tail each). One cache
per layer, the layers called in turn as a step does, so a layer's pages are not in cache from
its previous call unless the whole working set fits.

Prints, for the same contexts: the batch with shared prefix pages in scattered order (the
sharers of a prefix far apart in the batch, as arrivals put them), the same batch with sharers
adjacent, and the same contexts with private pages (nothing shared); p50/p90/p99 over
repetitions, GB/s of distinct KV bytes read, and ratios to the private-pages run and to a
streaming read of the same number of bytes measured here.

    python benchmarks/decode_attention.py                     # builtin:small's shape, bf16 where native
    python benchmarks/decode_attention.py --dtype float32 --batch 64 --suffix 400
"""

from __future__ import annotations

import argparse
import time

import torch

from engine import huge_pages
from engine.metrics.peak import measure_read_bandwidth
from engine.model.compute_dtype import resolve_dtype
from kernels import cpu_ops


def _percentiles(ms: list[float]) -> tuple[float, float, float]:
    s = sorted(ms)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return pick(0.5), pick(0.9), pick(0.99)


def _tables(batch: int, prefixes: int, prefix_pages: int, suffix_pages: int, grouped: bool, gen) -> torch.Tensor:
    """Page table rows: `prefixes` shared runs of pages (0 = every row private) then a private tail."""
    shared = prefixes > 0
    total = (prefixes if shared else batch) * prefix_pages + batch * suffix_pages
    perm = torch.randperm(total, generator=gen).to(torch.int32)
    heads = [perm[i * prefix_pages : (i + 1) * prefix_pages] for i in range(prefixes if shared else batch)]
    used = len(heads) * prefix_pages
    rows = []
    for b in range(batch):
        head = heads[(b * prefixes // batch if grouped else b % prefixes) if shared else b]
        rows.append(torch.cat([head, perm[used : used + suffix_pages]]))
        used += suffix_pages
    return torch.stack(rows).contiguous()


def _run(args, dtype, table: torch.Tensor, gen) -> list[float]:
    pages = int(table.max()) + 1
    shape = (pages, args.page_size, args.kv_heads, args.head_dim)
    # On transparent huge pages where the OS allows, as the engine's KV cache (engine/kv_cache.py):
    # with 4 KiB pages a step's scattered reads would measure page walks.
    # All layers' caches in one allocation, advised before anything writes it: a cache of a few
    # MB made on its own comes from the heap, where freed temporaries leave memory already faulted
    # in as 4 KiB pages (measured: 170 MB of 450 on huge pages so), while the engine's
    # per-layer caches are big enough to be mapped afresh, on huge pages (engine/kv_cache.py).
    store = huge_pages.empty((args.layers, 2) + shape, dtype)
    store.normal_(generator=gen)
    caches = [(store[i, 0], store[i, 1]) for i in range(args.layers)]
    context = (table.shape[1] - args.suffix_pages) * args.page_size + args.suffix
    query = torch.randn(args.batch, args.heads, args.head_dim, generator=gen).to(dtype)
    starts = torch.arange(args.batch + 1, dtype=torch.int32)
    lens = torch.full((args.batch,), context, dtype=torch.int32)
    scale = args.head_dim**-0.5
    ms = []
    for i in range(args.warmup + args.repeat):
        t0 = time.perf_counter()
        for k_cache, v_cache in caches:
            cpu_ops.paged_attention(query, k_cache, v_cache, table, starts, lens, scale)
        if i >= args.warmup:
            ms.append((time.perf_counter() - t0) * 1e3)
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto", help="auto (bf16 where the CPU has it natively), bfloat16, float32")
    parser.add_argument("--batch", type=int, default=32, help="decode tokens per step")
    parser.add_argument("--prefixes", type=int, default=8, help="shared prefixes among the batch")
    parser.add_argument("--prefix", type=int, default=1024, help="tokens per shared prefix (whole pages)")
    parser.add_argument("--suffix", type=int, default=200, help="private tokens per sequence after its prefix")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    if cpu_ops.load() is None:
        raise SystemExit(f"the CPU extension is unavailable: {cpu_ops.load_error()}")
    if args.prefix % args.page_size:
        raise SystemExit(f"--prefix must be a multiple of --page-size ({args.page_size})")
    if args.prefixes < 1 or args.batch < args.prefixes:
        raise SystemExit("--prefixes must be between 1 and --batch")
    dtype = resolve_dtype(args.dtype, "cpu")
    args.prefix_pages = args.prefix // args.page_size
    args.suffix_pages = -(-args.suffix // args.page_size)
    gen = torch.Generator().manual_seed(0)
    elem = torch.tensor([], dtype=dtype).element_size()
    token_bytes = 2 * args.kv_heads * args.head_dim * elem * args.layers  # K and V, every layer
    context = args.prefix + args.suffix
    shared_bytes = (args.prefixes * args.prefix + args.batch * args.suffix) * token_bytes
    private_bytes = args.batch * context * token_bytes
    floor = measure_read_bandwidth(max(private_bytes, 256 << 20)) / 1e9
    print(f"{args.batch} decodes x {context} tokens ({args.prefixes} shared {args.prefix}-token prefixes), "
          f"{args.layers} layers, {args.heads}/{args.kv_heads} heads x {args.head_dim}, {dtype}, "
          f"{torch.get_num_threads()} threads; streaming read {floor:.1f} GB/s")
    runs = [
        ("private pages (nothing shared)", _tables(args.batch, 0, args.prefix_pages, args.suffix_pages, False, gen),
         private_bytes),
        ("shared prefixes, scattered", _tables(args.batch, args.prefixes, args.prefix_pages, args.suffix_pages,
                                               False, gen), shared_bytes),
        ("shared prefixes, adjacent", _tables(args.batch, args.prefixes, args.prefix_pages, args.suffix_pages,
                                              True, gen), shared_bytes),
    ]
    print(f"{'batch':34} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'GB/s':>7} {'vs private':>10} {'vs read':>8}")
    base = None
    for name, table, nbytes in runs:
        p50, p90, p99 = _percentiles(_run(args, dtype, table, gen))
        base = base or p50
        gbs = nbytes / p50 / 1e6
        print(f"{name:34} {p50:8.2f} {p90:8.2f} {p99:8.2f} {gbs:7.1f} {base / p50:9.2f}x {gbs / floor:7.2f}x")


if __name__ == "__main__":
    main()
