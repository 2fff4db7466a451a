"""`pdserve complete`, `generate` and `demo`: one prompt in-process, to a running router, or
through a cluster started for it (cluster/lifecycle.py)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from cluster.cmd_cluster import say

if TYPE_CHECKING:
    from configs import ClusterConfig


def complete(args: argparse.Namespace) -> int:
    from configs import EngineConfig
    from configs.engine import SpeculativeConfig
    from engine import LLMEngine, SamplingParams

    method = args.speculative_method
    if method == "draft" and args.draft_model is None:
        raise SystemExit("pdserve: --speculative-method draft needs --draft-model DIR (a model with the same tokenizer)")
    if method == "medusa" and args.medusa_heads is None:
        raise SystemExit("pdserve: --speculative-method medusa needs --medusa-heads DIR (heads made for the model)")
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, ignore_eos=args.ignore_eos, speculative_method=method,
        num_speculative_tokens=args.num_speculative_tokens,
    )
    # Given both, the heads are the default and a request may still ask for the draft.
    loaded = {"draft_model": args.draft_model, "medusa_heads": args.medusa_heads}
    if args.medusa_heads:
        speculative = SpeculativeConfig(method="medusa", **loaded)
    elif args.draft_model:
        speculative = SpeculativeConfig(method="draft", **loaded)
    else:
        speculative = SpeculativeConfig()
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, speculative=speculative))
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
                    f"[{n} tokens, finish={out.finish_reason.value if out.finish_reason else None}, "
                    f"prompt {out.num_prompt_tokens} tokens, "
                    f"TTFT {1000 * (first_token_at - start):.1f} ms, {n / elapsed:.1f} tok/s"
                    f"{_speculated(out.num_spec_proposed, out.num_spec_accepted)}]",
                    file=sys.stderr,
                )
    return 0


def demo(args: argparse.Namespace) -> int:
    """Up, one streamed request, down: the README's first command."""
    from cluster.lifecycle import Cluster
    from configs import load_cluster_config

    config = load_cluster_config(args.config)
    with Cluster(config, args.config, say=say) as cluster:
        args.address, args.config = cluster.grpc_address, None
        say(f"pdserve: sending {args.prompt!r} to the router at {cluster.grpc_address}\n")
        sys.stdout.write(args.prompt)
        code = generate(args, config)
    say("pdserve: cluster stopped")
    return code


def generate(args: argparse.Namespace, config: ClusterConfig | None = None) -> int:
    """Streams one reply from the router at --address, or of the cluster --config (or `config`,
    the YAML `demo` started) names, presenting the key and TLS settings it asks for."""
    import grpc

    from cluster.client_auth import client_auth
    from proto import pdserve_pb2 as pb
    from proto import pdserve_pb2_grpc

    address = args.address
    if address is None:
        from cluster import launcher
        from configs import load_cluster_config

        if args.config is None:
            raise SystemExit("pdserve: give --config CONFIG.yaml (of a cluster started with 'pdserve up') or --address")
        state = launcher.read_state(args.config)
        config = load_cluster_config(args.config)
        address = state["grpc_address"] if state else f"{config.router.host}:{config.router.grpc_port}"
    auth = client_auth(args, config)
    sampling = pb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                 top_p=args.top_p, ignore_eos=args.ignore_eos, stop=args.stop or [])
    if args.seed is not None:
        sampling.seed = args.seed
    if args.speculative_method is not None:
        sampling.speculative_method = args.speculative_method
    if args.num_speculative_tokens is not None:
        sampling.num_speculative_tokens = args.num_speculative_tokens
    with auth.grpc_channel(address) as channel:
        stub = pdserve_pb2_grpc.GenerationStub(channel)
        try:
            for resp in stub.Generate(pb.GenerateRequest(text=args.prompt, sampling=sampling), timeout=args.timeout,
                                      metadata=auth.grpc_metadata()):
                sys.stdout.write(resp.text)
                sys.stdout.flush()
                last = resp
        except grpc.RpcError as exc:
            print(f"\npdserve: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    u = last.usage
    print(f"\n[{u.completion_tokens} tokens, finish={pb.FinishReason.Name(last.finish_reason)}, "
          f"prompt {u.prompt_tokens} tokens ({u.cached_prompt_tokens} cached), TTFT {1000 * u.ttft_s:.1f} ms"
          f"{_speculated(u.spec_proposed_tokens, u.spec_accepted_tokens)}]", file=sys.stderr)
    return 0


def _speculated(num_proposed: int, num_accepted: int) -> str:
    """The summary line's speculative counts, where anything was proposed."""
    if not num_proposed:
        return ""
    return f", speculative: {num_accepted}/{num_proposed} proposed tokens accepted"
