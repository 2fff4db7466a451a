"""The `pdserve` command line.

    pdserve complete "def add(a, b):" --model builtin:tiny --max-tokens 32   # offline, in-process
    pdserve model build builtin:tiny --out ./tiny                             # write a checkpoint

Sub-commands arrive with their issues (`up`, `down`, `generate`, `scale`, `status`, `bench`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence


def _cmd_complete(args: argparse.Namespace) -> int:
    from engine import LLMEngine, SamplingParams
    from configs import EngineConfig

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, ignore_eos=args.ignore_eos,
    )
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype))
    prompt_ids = engine.encode(args.prompt)
    engine.add_request("cli", prompt_ids, params)
    start = time.perf_counter()
    first_token_at = None
    shown = ""
    sys.stdout.write(args.prompt)
    while engine.has_unfinished_requests():
        for out in engine.step():
            first_token_at = first_token_at or time.perf_counter()
            # Re-decode the whole output each time: a multi-byte character split across tokens
            # only becomes printable once its last byte arrives.
            text = engine.decode(out.token_ids)
            if not text.endswith("\ufffd"):
                sys.stdout.write(text[len(shown):])
                sys.stdout.flush()
                shown = text
            if out.finished:
                sys.stdout.write(text[len(shown):] + "\n")
                elapsed = time.perf_counter() - start
                n = len(out.token_ids)
                print(
                    f"[{n} tokens, finish={out.finish_reason.value}, prompt {out.num_prompt_tokens} tokens, "
                    f"TTFT {1000 * (first_token_at - start):.1f} ms, {n / elapsed:.1f} tok/s]",
                    file=sys.stderr,
                )
    return 0


def _cmd_model_build(args: argparse.Namespace) -> int:
    from engine.builtin_models import build_builtin, parse_builtin

    name = parse_builtin(args.name)
    if name is None:
        raise SystemExit(f"pdserve: {args.name!r} is not a built-in model name (builtin:tiny, builtin:small)")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise SystemExit(f"pdserve: {args.out} exists and is not a directory")
    if os.path.exists(args.out) and os.listdir(args.out) and not args.force:
        raise SystemExit(f"pdserve: {args.out} exists and is not empty (use --force to overwrite)")
    out = build_builtin(name, args.out)
    print(f"wrote {args.name} to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="pdserve: disaggregated prefill/decode LLM serving. Models are 'builtin:tiny', "
        "'builtin:small' (made locally on first use) or a local Hugging Face directory "
        "(Llama, Mistral or Qwen2 family, safetensors weights).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    complete = sub.add_parser("complete", help="generate a completion in-process with the engine (no cluster)")
    complete.add_argument("prompt", help="prompt text")
    complete.add_argument("--model", default="builtin:tiny", help="model name or directory (default: builtin:tiny)")
    complete.add_argument("--max-tokens", type=int, default=48, help="tokens to generate at most (default: 48)")
    complete.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    complete.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    complete.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default: 1)")
    complete.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    complete.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    complete.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    complete.set_defaults(func=_cmd_complete)

    model = sub.add_parser("model", help="manage checkpoints")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    build = model_sub.add_parser("build", help="write a built-in model in Hugging Face format to a directory")
    build.add_argument("name", help="builtin:tiny or builtin:small")
    build.add_argument("--out", required=True, help="directory to write (config.json, model.safetensors, tokenizer.json)")
    build.add_argument("--force", action="store_true", help="write into a non-empty directory")
    build.set_defaults(func=_cmd_model_build)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
