"""pdserve against vLLM-CPU on the same machine, checkpoint, dtype and seeded requests.

    python benchmarks/vs_vllm.py                       # vLLM, colocated and 1P1D (~25 min)
    python benchmarks/vs_vllm.py --systems vllm,colocated --quick

The peer is served by ../shared/peer/vllm_cpu.sh (run its `setup` once); pdserve clusters come
from configs/bench/vs-vllm-*.yaml. The systems run one after the other, alone on the machine,
each driven by the same OpenAI streaming client (`pdserve bench --backend openai`) with the
same seeded prompts and arrival times:

  unloaded  one request at a time, 128-token prompts, 128 out: batch-1 TTFT, TPOT and ITL
  slo-base  one request at a time in the sweep's shape (512 in, 128 out): the SLO's base values
  burst     64 requests of 512 tokens (128 out), at most 32 in flight: saturation throughput
  moderate  Poisson at half of vLLM's burst rate: TPOT p50 under moderate load
  sweep     Poisson at --rates (default: 0.25-1.25x vLLM's burst throughput): SLO attainment per
            rate, the highest rate at >= 90%
  prefix    8 shared 1024-token prefixes + 128 unique tokens each, burst, 32 in flight

SLO (stated in the output): TTFT and TPOT at 3x the best p50 of any system's slo-base run in this
run, the same targets for every system; calibrated on the sweep's own prompt shape, since a
512-token prompt cannot meet a TTFT target set by a 128-token one. The memory-bandwidth floor of a batch-1 token is the
model's weight bytes over a streaming read measured here, before any server starts.
Writes every run's JSON/CSV and `summary.md` under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from loadgen.metrics import SLO
from loadgen.results import BenchResult, write_result
from loadgen.runner import BenchPlan, run_bench
from loadgen.workloads import LengthDist, WorkloadSpec

CONFIGS = {"colocated": REPO / "configs/bench/vs-vllm-colocated.yaml", "1p1d": REPO / "configs/bench/vs-vllm-1p1d.yaml",
           "adaptive": REPO / "configs/bench/vs-vllm-adaptive.yaml"}
VLLM_PORT = 8011


def workloads(quick: bool, vocab: int) -> dict[str, tuple[WorkloadSpec, dict]]:
    """name -> (workload, BenchPlan options other than rates)."""
    n = 2 if quick else 1  # --quick halves request counts

    def fixed(name: str, num: int, inp: int, out: int, seed: int, **extra) -> WorkloadSpec:
        return WorkloadSpec(name, max(2, num // n), LengthDist(inp), LengthDist(out), vocab_size=vocab, seed=seed,
                            **extra)

    # A seed of its own per workload: no workload may hit the prefix cache another one filled.
    return {
        "unloaded": (fixed("fixed", 8, 128, 128, seed=101), dict(max_concurrency=1)),
        "slo-base": (fixed("fixed", 4, 512, 128, seed=606), dict(max_concurrency=1)),
        "burst": (fixed("throughput", 64, 512, 128, seed=202), dict(max_concurrency=32)),
        "moderate": (fixed("fixed", 32, 512, 128, seed=303), {}),
        "sweep": (fixed("sweep", 32, 512, 128, seed=404), {}),
        "prefix": (fixed("prefix", 64, 1024, 128, seed=505, num_prefixes=8, suffix_len=128), dict(max_concurrency=32)),
    }


def weight_bytes(model_dir: Path, dtype_bytes: int) -> int:
    """Bytes of every weight in the served dtype (tied embeddings counted once)."""
    from safetensors import safe_open

    from engine.model.loader import safetensors_files

    total = 0
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                total += math.prod(f.get_slice(name).get_shape()) * dtype_bytes
    return total


class VllmServer:
    """vLLM-CPU started and stopped through the peer script."""

    def __init__(self, script: Path, model_dir: Path, dtype: str) -> None:
        self.script, self.model_dir, self.dtype = script, model_dir, dtype
        self.address = f"http://127.0.0.1:{VLLM_PORT}"

    def __enter__(self) -> VllmServer:
        subprocess.run(["bash", str(self.script), "start", str(self.model_dir), str(VLLM_PORT), self.dtype], check=True)
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run(["bash", str(self.script), "stop"], check=False)


class PdserveCluster:
    def __init__(self, config_path: Path, model_dir: Path, dtype: str) -> None:
        from configs import load_cluster_config

        config = load_cluster_config(config_path)
        # The same checkpoint directory and dtype the peer serves.
        data = config.model_dump()
        data["model"] = str(model_dir)
        for pool in ("colocated", "prefill", "decode"):
            if data.get(pool):
                data[pool]["engine"]["dtype"] = dtype
        self.config = type(config).model_validate(data)
        self.address = f"http://127.0.0.1:{self.config.router.http_port}"

    def __enter__(self) -> PdserveCluster:
        from cluster import launcher

        self.cluster = launcher.up(self.config, timeout_s=600)
        return self

    def __exit__(self, *exc) -> None:
        self.cluster.shutdown()


def run_plans(name: str, address: str, plans: dict[str, BenchPlan], out: Path) -> dict[str, BenchResult]:
    results = {}
    for wname, plan in plans.items():
        print(f"== {name}: {wname}", flush=True)
        result = run_bench("openai", address, plan, f"{name}-{wname}", progress=False)
        write_result(result, out)
        results[wname] = result
    return results


def p50(result: BenchResult, metric: str, run: int = 0) -> float:
    return getattr(result.runs[run].summary(), metric)["p50"]


def report(all_results: dict[str, dict[str, BenchResult]], floor_s: float, slo: SLO, moderate_rate: float,
           bandwidth: float, wbytes: int) -> str:
    base = all_results["vllm"]
    others = [s for s in all_results if s != "vllm"]

    def burst_rps(r):
        return r["burst"].runs[0].summary().request_throughput

    def prefix_rps(r):
        return r["prefix"].runs[0].summary().request_throughput

    def best_rate(r):
        return dataclasses.replace(r["sweep"], slo=slo).max_rate_at_attainment()

    rows = [  # (metric, value fn, higher is better, target)
        ("burst throughput (req/s)", burst_rps, True, ">= 1.2x"),
        ("highest rate at >= 90% SLO attainment (req/s)", best_rate, True, ">= 1.2x"),
        (f"TPOT p50 at {moderate_rate:.2f} req/s (ms)", lambda r: 1e3 * p50(r["moderate"], "tpot"), False, "<= 1x"),
        ("shared-prefix throughput (req/s)", prefix_rps, True, ">= 1.2x"),
        ("batch-1 ITL p50 (ms)", lambda r: 1e3 * p50(r["unloaded"], "itl"), False, "<= 1x"),
        ("batch-1 TTFT p50 (ms)", lambda r: 1e3 * p50(r["unloaded"], "ttft"), False, ""),
    ]
    head = "| metric | vLLM-CPU | " + " | ".join(f"pdserve {s} | ratio" for s in others) + " | target |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    def shown(value: float) -> str:  # NaN: no such value (no rate met the SLO)
        return "none" if math.isnan(value) else f"{value:.3g}"

    for metric, fn, higher, target in rows:
        ref = fn(base)
        cells = [shown(ref)]
        for s in others:
            value = fn(all_results[s])
            ratio = value / ref if higher else ref / value
            cells += [shown(value), "-" if math.isnan(ratio) else f"**{ratio:.2f}x**"]
        lines.append(f"| {metric} | " + " | ".join(cells) + f" | {target} |")
    lines.append("")
    lines.append("ratio: pdserve's advantage (> 1 is better for pdserve), whichever way the metric points.")
    lines.append(f"SLO for attainment: TTFT {1e3 * slo.ttft_s:.0f} ms, TPOT {1e3 * slo.tpot_s:.1f} ms "
                 "(3x the best p50 of any system at one request at a time, 512 in / 128 out, in this run).")
    lines.append(f"Batch-1 floor: {wbytes / 1e6:.0f} MB of weights / {bandwidth / 1e9:.1f} GB/s read = "
                 f"{1e3 * floor_s:.2f} ms per token; batch-1 ITL p50 / floor: "
                 + ", ".join(f"{s} {p50(r['unloaded'], 'itl') / floor_s:.2f}x" for s, r in all_results.items()))
    for system, results in all_results.items():
        sweep = dataclasses.replace(results["sweep"], slo=slo)
        attain = ", ".join(f"{run.rate:g}: {run.summary(slo).attainment:.0%}" for run in sweep.runs)
        failed = sum(run.summary().num_failed for r in results.values() for run in r.runs)
        lines.append(f"{system}: attainment by rate {attain}; failed requests {failed}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--model", default="builtin:small", help="built-in name or HF directory both systems serve")
    parser.add_argument("--dtype", default="float32", help="given to both systems (default float32)")
    parser.add_argument("--systems", default="vllm,colocated,1p1d", help="comma list of vllm, colocated, 1p1d, adaptive")
    parser.add_argument("--rates", default="", help="Poisson rates of the sweep (req/s); default: --rate-fractions "
                        "of vLLM's burst throughput measured in this run, so the sweep reaches saturation on any machine")
    parser.add_argument("--rate-fractions", default="0.25,0.5,0.75,1,1.25",
                        help="the sweep's rates as fractions of vLLM's burst throughput (when --rates is not given)")
    parser.add_argument("--quick", action="store_true", help="half the requests per workload")
    parser.add_argument("--peer-script", default=str(REPO.parent / "shared/peer/vllm_cpu.sh"))
    parser.add_argument("--out", default=str(REPO / "docs/bench/vs-vllm"))
    args = parser.parse_args(argv)

    from engine.model.compute_dtype import resolve_dtype
    from engine.model.loader import resolve_model_path

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - {"vllm", *CONFIGS}
    if unknown or "vllm" not in systems:
        parser.error(f"--systems must include vllm and name only vllm, colocated, 1p1d, adaptive (got {args.systems})")
    rates = tuple(float(r) for r in args.rates.split(",") if r.strip())  # () = planned from vLLM's burst
    fractions = tuple(float(f) for f in args.rate_fractions.split(",") if f.strip())
    model_dir = resolve_model_path(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype_bytes = resolve_dtype(args.dtype, "cpu").itemsize
    from engine.metrics.peak import measure_read_bandwidth  # torch: only where the floor is measured

    bandwidth = measure_read_bandwidth()
    wbytes = weight_bytes(model_dir, dtype_bytes)
    floor_s = wbytes / bandwidth
    print(f"model {model_dir} ({wbytes / 1e6:.0f} MB in {args.dtype}); read bandwidth {bandwidth / 1e9:.1f} GB/s; "
          f"batch-1 floor {1e3 * floor_s:.2f} ms/token", flush=True)

    specs = workloads(args.quick, vocab=32000)
    all_results: dict[str, dict[str, BenchResult]] = {}
    moderate_rate = math.nan
    for system in systems:  # vllm first: the moderate rate is half of its burst rate
        plans = {}
        for name, (spec, opts) in specs.items():
            if name in ("sweep", "moderate") and system == "vllm" and (name == "moderate" or not rates):
                continue  # planned once the burst has measured vLLM's saturation rate
            if name == "sweep":
                plans[name] = BenchPlan(spec, rates=rates, **opts)
            elif name == "moderate":
                plans[name] = BenchPlan(spec, rates=(moderate_rate,), **opts)
            else:
                plans[name] = BenchPlan(spec, **opts)
        if system == "vllm":
            with VllmServer(Path(args.peer_script), model_dir, args.dtype) as server:
                results = run_plans(system, server.address, {k: plans[k] for k in ("unloaded", "slo-base", "burst")}, out)
                saturation = results["burst"].runs[0].summary().request_throughput
                moderate_rate = round(0.5 * saturation, 3)
                plans["moderate"] = BenchPlan(specs["moderate"][0], rates=(moderate_rate,))
                if not rates:
                    rates = tuple(round(f * saturation, 2) for f in fractions)
                    plans["sweep"] = BenchPlan(specs["sweep"][0], rates=rates, **specs["sweep"][1])
                results |= run_plans(system, server.address, {k: plans[k] for k in ("moderate", "sweep", "prefix")},
                                     out)
        else:
            with PdserveCluster(CONFIGS[system], model_dir, args.dtype) as server:
                results = run_plans(system, server.address, plans, out)
        all_results[system] = results

    best = {m: min(p50(r["slo-base"], m) for r in all_results.values()) for m in ("ttft", "tpot")}
    slo = SLO(ttft_s=3 * best["ttft"], tpot_s=3 * best["tpot"])
    text = report(all_results, floor_s, slo, moderate_rate, bandwidth, wbytes)
    command = "python benchmarks/vs_vllm.py " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "summary.md").write_text(f"`{command.strip()}`\n\n{text}\n")
    (out / "summary.json").write_text(json.dumps({"slo": dataclasses.asdict(slo), "moderate_rate": moderate_rate,
                                                  "floor_s": floor_s}, indent=2))
    print("\n" + text)


if __name__ == "__main__":
    main()
