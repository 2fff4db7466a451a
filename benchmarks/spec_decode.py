"""Speculative decoding benchmark: tokens/s with each method vs without, measured side by side.

    python benchmarks/spec_decode.py                                  # builtin:tiny, quick
    python benchmarks/spec_decode.py --layer-scale 0.36               # builtin:tiny made repetitive
    python benchmarks/spec_decode.py --model /path/to/hf-model --num-prompts 8 --max-tokens 128
    python benchmarks/spec_decode.py --layer-scale 0.36 --draft-layers 1     # + a draft: the target's first layer
    python benchmarks/spec_decode.py --model builtin:code-small --draft-model builtin:code-draft
    python benchmarks/spec_decode.py --model builtin:code-small --medusa-heads builtin:code-medusa

Workload: code-completion prompts cut from this Python's standard library sources, from the
files the trained built-ins hold out (engine/model/train_corpus.py's split: never trained on;
files chosen with --seed, each prompt the first --prompt-tokens tokens of a file that has them),
greedy, EOS ignored so every run emits the same number of tokens. Prefix caching is off, so a
prompt costs the same prefill whichever method runs it.

1. Concurrency 1: each prompt alone, once per method (the order alternating from prompt to
   prompt), on one engine whose requests choose the method (SamplingParams.speculative_method),
   so every method runs on the same weights and threads (`draft` and `prompt_lookup+draft` too,
   with --draft-model or --draft-layers; `medusa` with --medusa-heads). The cost policy (speculative.cost_policy) is off
   here, so each method runs as it is, losing or not; --fixed-k turns the adaptive k off too. Prints per-method decode tokens/s
   (first token to last: prefill excluded; p50/p90 over prompts and the aggregate), the ratio to
   `none`, the time to first token (p50; it holds the draft's prompt KV, computed beside the
   target's prefill), the acceptance rate and the mean accepted length (tokens emitted per verifying step,
   the target's own included; a fallback method's also by the part that proposed), whether
   every method's tokens equal `none`'s (greedy speculation is exact), and how much of `none`'s
   output repeats itself: the share of its tokens that end an 8-token run seen earlier in the
   prompt or output, by thirds of the output. A small model loops as it runs on (builtin:code-small
   on the 12 default prompts at --max-tokens 256: 0.47, 0.83 and 0.94 of each third; at 64
   tokens 0.12, 0.45 and 0.61), and prompt lookup copies loops: read a ratio with that share.
2. Saturation: --batch-size prompts at once (continuous batching), speculation on (the engine's
   adaptive default, with its max_batch_tokens, max_batch_seqs and cost policy, unless
   --no-cost-policy; --saturation-method) vs off, --repeats times alternately; prints the best
   tokens/s of each, the ratio (below 0.95 would be a regression to report), whether the outputs
   are equal, and the cost policy's estimates.

A random built-in model never repeats itself, so prompt lookup is almost never right on it and
its acceptance means nothing. --layer-scale S runs a copy of the model whose decoder layers'
projections are scaled by S (0.36 on builtin:tiny: the test suite's repetitive fixture), which
repeats with context-dependent breaks: acceptance is then real but says nothing about a trained
model on real code. Read speed-ups only from a trained model.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

from configs import EngineConfig
from engine import LLMEngine, SamplingParams
from engine.model.loader import resolve_model_path
from engine.model.train_corpus import split_corpus

METHODS = ("none", "prompt_lookup")  # and "draft", "prompt_lookup+draft" / "medusa" with a draft model / heads


def scaled_copy(model: str, scale: float, out_dir: Path) -> str:
    """A copy of the checkpoint with its decoder layers' projections (not the norms) times `scale`."""
    from safetensors.torch import load_file, save_file

    dst = out_dir / "model"
    shutil.copytree(resolve_model_path(model), dst)
    for weights in dst.glob("*.safetensors"):
        tensors = {name: t * scale if "layers." in name and "norm" not in name else t
                   for name, t in load_file(weights).items()}
        save_file(tensors, weights, metadata={"format": "pt"})
    return str(dst)


def truncated_copy(model: str, num_layers: int, out_dir: Path) -> str:
    """A copy of the checkpoint keeping its first `num_layers` decoder layers: a draft that shares
    the target's vocabulary and agrees with it often, with no training."""
    import json

    from safetensors.torch import load_file, save_file

    dst = out_dir / "draft"
    shutil.copytree(model if Path(model).is_dir() else resolve_model_path(model), dst)
    for weights in dst.glob("*.safetensors"):
        tensors = {name: t for name, t in load_file(weights).items()
                   if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers}
        save_file(tensors, weights, metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return str(dst)


def stdlib_prompts(encode: Callable[[str], list[int]], n: int, num_tokens: int, seed: int) -> list[list[int]]:
    """Code-completion prompts from the held-out split of the trained built-ins' corpus
    (engine/model/train_corpus.py: stdlib files builtin:code-small never trained on), each the
    first `num_tokens` tokens of a file that has them, files in an order shuffled by `seed`.
    Raises SystemExit when too few held-out files are long enough."""
    split = split_corpus()
    files = sorted(split.held_out)
    random.Random(seed).shuffle(files)
    prompts, names = [], []
    for rel in files:
        ids = encode(split.read(rel))
        if len(ids) >= num_tokens:
            prompts.append(ids[:num_tokens])
            names.append(rel)
        if len(prompts) == n:
            assert not set(names) & set(split.train)
            print(f"prompts: the first {num_tokens} tokens of {n} held-out stdlib files "
                  f"({len(split.held_out)} held out, {len(split.train)} trained on): {', '.join(names)}")
            return prompts
    sys.exit(f"only {len(prompts)} of the {len(files)} held-out stdlib files have {num_tokens} tokens; "
             f"{n} prompts were asked for")


def generate(engine: LLMEngine, prompts: list[list[int]],
             params: SamplingParams) -> tuple[float, float, list[list[int]]]:
    """Runs the prompts to completion together; returns the wall time, the time from the first
    token to the end, and each prompt's tokens (in prompt order)."""
    start = time.perf_counter()
    first = None
    ids = [f"b{i}-{time.perf_counter_ns()}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        if first is None and any(o.new_token_ids for o in outs):
            first = time.perf_counter()
        for out in outs:
            if out.finished:
                outputs[out.request_id] = out.token_ids
    end = time.perf_counter()
    return end - start, end - (first or start), [outputs[i] for i in ids]


REPEAT_NGRAM = 8


def repeated_share(prompt: list[int], output: list[int], n: int = REPEAT_NGRAM) -> list[bool]:
    """Per output token: whether it ends an n-token run that occurred earlier in prompt + output."""
    tokens = prompt + output
    seen: set[tuple[int, ...]] = set()
    flags = []
    for end in range(n, len(tokens) + 1):
        gram = tuple(tokens[end - n:end])
        if end > len(prompt):
            flags.append(gram in seen)
        seen.add(gram)
    return [False] * (len(output) - len(flags)) + flags


def describe_repetition(prompts: list[list[int]], outputs: list[list[int]]) -> str:
    """The share of output tokens that repeat an earlier 8-gram, over the output's thirds."""
    flags = [repeated_share(p, o) for p, o in zip(prompts, outputs)]
    length = min(len(f) for f in flags)
    cuts = [0, length // 3, 2 * length // 3, length]
    parts = []
    for lo, hi in zip(cuts, cuts[1:]):
        hits = sum(sum(f[lo:hi]) for f in flags)
        parts.append(f"tokens {lo}-{hi}: {hits / max(1, len(flags) * (hi - lo)):.2f}")
    return f"  none's output repeating an earlier {REPEAT_NGRAM}-gram: " + ", ".join(parts)


def concurrency_one(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, methods: tuple[str, ...]) -> bool:
    rates: dict[str, list[float]] = {m: [] for m in methods}
    ttfts: dict[str, list[float]] = {m: [] for m in methods}  # seconds: a draft's prompt KV is computed there
    decode_s = {m: 0.0 for m in methods}
    tokens: dict[str, list[list[int]]] = {m: [] for m in methods}
    # method -> proposing method -> [proposed, accepted, verified] over that method's runs (a
    # fallback method's parts are counted apart: engine.speculator.totals is by who proposed).
    counts: dict[str, dict[str, list[int]]] = {m: {} for m in methods}
    for i, prompt in enumerate(prompts):
        for method in methods if i % 2 == 0 else reversed(methods):
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, speculative_method=method)
            before = _totals(engine)
            wall, seconds, [out] = generate(engine, [prompt], params)
            ttfts[method].append(wall - seconds)
            for label, now in _totals(engine).items():
                if now == (then := before.get(label, (0, 0, 0))):
                    continue
                mine = counts[method].setdefault(label, [0, 0, 0])
                for j in range(3):
                    mine[j] += now[j] - then[j]
            rates[method].append((len(out) - 1) / seconds)
            decode_s[method] += seconds
            tokens[method].append(out)
    num_decoded = len(prompts) * (max_tokens - 1)
    base = num_decoded / decode_s["none"]
    print(f"concurrency 1: {len(prompts)} prompts x {max_tokens} tokens (decode tokens/s: prefill excluded)")
    all_same = True
    for method in methods:
        agg = num_decoded / decode_s[method]
        q = statistics.quantiles(rates[method], n=10) if len(rates[method]) > 1 else rates[method] * 9
        same = tokens[method] == tokens["none"]
        all_same &= same
        line = (f"  {method:19s} {agg:8.1f} tok/s  (per prompt p50={statistics.median(rates[method]):.1f} "
                f"p90={q[8]:.1f})  ratio vs none = {agg / base:.2f}  TTFT p50 "
                f"{statistics.median(ttfts[method]) * 1e3:.1f} ms")
        if method != "none":
            proposed, accepted, verified = (sum(c[j] for c in counts[method].values()) for j in range(3))
            line += _acceptance(proposed, accepted, verified)
            line += f"  outputs equal to none: {'yes' if same else 'NO'}"
        print(line)
        if len(counts[method]) > 1:  # a fallback method: each part's share
            for label, (proposed, accepted, verified) in sorted(counts[method].items()):
                print(f"    by {label:16s}" + _acceptance(proposed, accepted, verified))
    print(describe_repetition(prompts, tokens["none"]))
    return all_same


def _totals(engine: LLMEngine) -> dict[str, tuple[int, int, int]]:
    return {m: (c.num_proposed, c.num_accepted, c.num_verified) for m, c in engine.speculator.totals.items()}


def _acceptance(proposed: int, accepted: int, verified: int) -> str:
    if not verified:
        return "  nothing proposed"
    return (f"  acceptance rate {accepted / proposed:.2f}  mean accepted length "
            f"{(accepted + verified) / verified:.2f}  ({proposed} proposed in {verified} verifications)")


def saturation(model: str, dtype: str, prompts: list[list[int]], max_tokens: int, repeats: int,
               speculative: dict, cost_policy: bool) -> bool:
    common = dict(model=model, dtype=dtype, max_num_seqs=len(prompts), enable_prefix_caching=False)
    engines = {"off": LLMEngine(EngineConfig(**common)),
               "on": LLMEngine(EngineConfig(**common, speculative=speculative | {"cost_policy": cost_policy}))}
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    best = {name: float("inf") for name in engines}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(repeats):
        for name, engine in engines.items():
            seconds, _, outputs[name] = generate(engine, prompts, params)
            best[name] = min(best[name], seconds)
    total = len(prompts) * max_tokens
    on = engines["on"].speculator.totals.get(speculative["method"])
    same = outputs["on"] == outputs["off"]
    print(f"saturation: {len(prompts)} sequences x {max_tokens} tokens (prefill included), best of {repeats}")
    on_config = engines["on"].config.speculative
    print(f"  off {total / best['off']:8.1f} tok/s   on ({on_config.method}, adaptive, "
          f"max_batch_tokens={on_config.max_batch_tokens}, "
          f"max_batch_seqs={on_config.max_batch_seqs}, cost_policy={on_config.cost_policy}) "
          f"{total / best['on']:8.1f} tok/s   "
          f"ratio on/off = {best['off'] / best['on']:.3f}   proposed {on.num_proposed if on else 0}, "
          f"accepted {on.num_accepted if on else 0}   outputs equal: {'yes' if same else 'NO'}")
    print_cost_policy(engines["on"], "    ")
    return same


def print_cost_policy(engine: LLMEngine, indent: str) -> None:
    """The engine's cost-policy estimates and choices, one line per method and step size."""
    cost = engine.speculator.cost
    for line in cost.describe() if cost is not None else []:
        print(f"{indent}cost policy: {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin:tiny", help="builtin:tiny, builtin:small or a local HF directory")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--layer-scale", type=float, default=None,
                        help="run a copy of the model with decoder-layer projections times this (0.36: repetitive)")
    parser.add_argument("--draft-model", default=None,
                        help="adds method `draft`: this checkpoint (the target's tokenizer) proposes")
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="adds method `draft`: the (scaled) target cut to its first N layers proposes")
    parser.add_argument("--medusa-heads", default=None,
                        help="adds method `medusa`: these Medusa heads (a directory in Medusa's layout made for "
                        "the model, or builtin:code-medusa for builtin:code-small) propose")
    parser.add_argument("--saturation-method", choices=("prompt_lookup", "draft", "medusa", "prompt_lookup+draft"),
                        default="prompt_lookup")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--draft-vocab-size", type=int, default=None,
                        help="the draft scores only the first N token ids (speculative.draft_vocab_size)")
    parser.add_argument("--draft-quantization", choices=("none", "int8"), default=None,
                        help="the draft's layers on int8 weights (speculative.draft_quantization)")
    parser.add_argument("--fallback-ngram-min", type=int, default=None,
                        help="prompt_lookup+draft: prompt lookup's shortest match that proposes (default: the "
                        "engine's speculative.fallback_ngram_min)")
    parser.add_argument("--batch-size", type=int, default=32, help="saturation check: sequences at once (0: skip)")
    parser.add_argument("--max-batch-seqs", type=int, default=None,
                        help="speculative.max_batch_seqs for the saturation run (default: the engine's; 0: no limit)")
    parser.add_argument("--fixed-k", action="store_true",
                        help="concurrency 1: every step proposes --num-speculative-tokens (speculative.adaptive: "
                        "false); the saturation run keeps the adaptive k")
    parser.add_argument("--no-cost-policy", action="store_true",
                        help="saturation: speculate without the cost policy (speculative.cost_policy: false)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's, one per core; 1 when other work shares the cores)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="spec-bench-") as tmp:
        model = args.model if args.layer_scale is None else scaled_copy(args.model, args.layer_scale, Path(tmp))
        draft = args.draft_model
        if args.draft_layers is not None:
            draft = truncated_copy(model, args.draft_layers, Path(tmp))
        methods = METHODS + (("draft", "prompt_lookup+draft") if draft else ()) + (("medusa",) if args.medusa_heads else ())
        if args.saturation_method in ("draft", "prompt_lookup+draft") and not draft:
            parser.error(f"--saturation-method {args.saturation_method} needs --draft-model or --draft-layers")
        if args.saturation_method == "medusa" and not args.medusa_heads:
            parser.error("--saturation-method medusa needs --medusa-heads")
        speculative: dict = {"method": args.saturation_method, "num_tokens": args.num_speculative_tokens,
                             "draft_model": draft, "medusa_heads": args.medusa_heads}
        if args.max_batch_seqs is not None:
            speculative["max_batch_seqs"] = args.max_batch_seqs
        if args.fallback_ngram_min is not None:
            speculative["fallback_ngram_min"] = args.fallback_ngram_min
        if args.draft_vocab_size is not None:
            speculative["draft_vocab_size"] = args.draft_vocab_size
        if args.draft_quantization is not None:
            speculative["draft_quantization"] = args.draft_quantization
        concurrency_1 = speculative | {"cost_policy": False} | ({"adaptive": False} if args.fixed_k else {})
        engine = LLMEngine(EngineConfig(model=model, dtype=args.dtype, speculative=concurrency_1,
                                        enable_prefix_caching=False))
        scale = "" if args.layer_scale is None else f" (decoder layers x {args.layer_scale:g})"
        if draft:
            draft_params = sum(p.numel() for p in engine.speculator.proposers["draft"].draft.runner.model.parameters())
            target_params = sum(p.numel() for p in engine.model.parameters())
            scale += (f", draft {args.draft_model or f'its first {args.draft_layers} layer(s)'} "
                      f"({draft_params / 1e6:.1f}M parameters vs {target_params / 1e6:.1f}M)")
        if args.medusa_heads:
            heads = engine.speculator.proposers["medusa"].heads
            heads_params = sum(p.numel() for p in heads.parameters())
            scale += f", {len(heads)} Medusa heads {args.medusa_heads} ({heads_params / 1e6:.1f}M parameters)"
        print(f"model {args.model}{scale}, dtype {next(engine.model.parameters()).dtype}, "
              f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
              f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
        prompts = stdlib_prompts(engine.encode, max(args.num_prompts, args.batch_size), args.prompt_tokens, args.seed)
        generate(engine, prompts[:1], SamplingParams(max_tokens=4))  # warm-up
        ok = concurrency_one(engine, prompts[: args.num_prompts], args.max_tokens, methods)
        if args.batch_size:
            batch = (prompts * (args.batch_size // len(prompts) + 1))[: args.batch_size]
            ok &= saturation(model, args.dtype, batch, args.max_tokens, args.repeats, speculative,
                             not args.no_cost_policy)
    if not ok:
        sys.exit("speculative outputs differ from plain greedy")


if __name__ == "__main__":
    main()
