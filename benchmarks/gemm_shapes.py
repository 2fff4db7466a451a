"""The linear layers of one decoder layer (and the vocabulary projection) at decode and prefill
row counts: F.linear (MKL) vs the weight-streaming skinny kernel vs weights packed once for
oneDNN (kernels/packed_linear.py) vs what the engine's `linear` runs on those packed weights
(`engine`: kernels/cpu/packed_gemv.cpp where its max_rows takes the product, else oneDNN),
side by side in one run.

    python benchmarks/gemm_shapes.py                          # builtin:small shapes, float32 and bfloat16
    python benchmarks/gemm_shapes.py --rows 1,32,512 --dtypes float32
    python benchmarks/gemm_shapes.py --rows 512,1024 --dtypes bfloat16 --by-shape

Prints, per dtype and row count, each path's time for the whole set of shapes (median of 7
timings) and its GFLOP/s (with --by-shape, each shape on a line of its own as well); the skinny
kernel only up to engine.model.layers.SKINNY_MAX_ROWS rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from engine.model.config import ModelConfig
from engine.model.layers import SKINNY_MAX_ROWS, linear
from engine.model.loader import DTYPES, resolve_model_path
from kernels import cpu_ops, packed_linear


def layer_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of qkv, o, gate_up, down and the vocabulary projection."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i), (cfg.vocab_size, h)]


def median_time(fn, repeats: int = 7, inner: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--rows", default="1,4,16,32,64,512,2048")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--by-shape", action="store_true", help="also print each shape's times")
    args = parser.parse_args()
    cfg = ModelConfig.from_dir(resolve_model_path(args.model))
    shapes = layer_shapes(cfg)
    skinny = cpu_ops.skinny_linear if cpu_ops.load() is not None else None
    print(f"{args.model}: shapes (out, in) {shapes}; {torch.get_num_threads()} threads")
    for dtype in (DTYPES[d] for d in args.dtypes.split(",")):
        weights = [torch.randn(n, k).to(dtype) for n, k in shapes]
        packed = [packed_linear.pack(w) for w in weights]
        gemvs = {id(p): packed_linear.gemv_for(p, w) for p, w in zip(packed, weights)}
        for rows in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(rows, k).to(dtype) for _, k in shapes]
            paths = {"F.linear": lambda x, w, p: F.linear(x, w)}
            if skinny is not None and rows <= SKINNY_MAX_ROWS:
                paths["skinny"] = lambda x, w, p: skinny(x, w)
            if all(p is not None for p in packed):
                paths["packed"] = lambda x, w, p: packed_linear.apply(x, p, None)
                paths["engine"] = lambda x, w, p, gemvs=gemvs: linear(x, p, None, None, gemvs[id(p)])
            flops = [2 * rows * n * k for n, k in shapes]
            times = {name: [median_time(lambda fn=fn, x=x, w=w, p=p: fn(x, w, p)) for x, w, p in zip(xs, weights, packed)]
                     for name, fn in paths.items()}
            label = f"{str(dtype).removeprefix('torch.'):>9} rows {rows:5d}"
            if args.by_shape:
                for i, (n, k) in enumerate(shapes):
                    print(f"{label} {f'{n}x{k}':>10}: " + " | ".join(
                        f"{name} {1e3 * t[i]:8.3f} ms {flops[i] / t[i] / 1e9:5.0f} GFLOP/s" for name, t in times.items()))
            print(f"{label} {'all':>10}: " + " | ".join(
                f"{name} {1e3 * sum(t):8.2f} ms {sum(flops) / sum(t) / 1e9:5.0f} GFLOP/s" for name, t in times.items()),
                flush=True)


if __name__ == "__main__":
    main()
