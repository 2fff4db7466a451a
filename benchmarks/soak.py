"""Soak: a real 1P2D cluster under mixed load, its workers SIGKILLed now and then, clients
cancelling throughout; at the end nothing may be leaked, hung or wrong (issue 40 item 5).

Starts builtin:tiny (float32, so Hugging Face's float32 greedy `generate()` is the oracle) as
`pdserve up` runs it (cluster/lifecycle.py's Cluster: embedded Ray, one prefill and two decode
worker actors, the router actor, the supervisor that replaces dead workers), on loopback ports
chosen free. Then, for --duration-s, streaming gRPC `Generate` requests arrive as a seeded
Poisson stream: prompts from a fixed pool of varied lengths (3 to 400 tokens), max_tokens from
1 to 128, greedy or (--sampled-fraction) sampled, EOS ignored; each either runs to its end, or
carries a gRPC deadline, or a request `timeout_s` (the router's own deadline), or is cancelled by
its client at a random moment (a uniform time after sending, or after a uniform number of its
tokens). Every --kill-every-s (a seeded random interval), one worker is SIGKILLed, a random role
(prefill or decode) and then one of its workers: the pid its own actor
reports, checked to be a descendant of this process (never a process found by name); the kill
waits until the supervisor's replacement is healthy at the router. Kills stop --quiet-end-s
before the load does.

At the end it prints a table and exits non-zero when an invariant fails:
- pages leaked: KV pages still referenced on any worker, --settle-s after the last stream (0);
- ids left: request ids in any worker's tables (WorkerHost.held_request_ids) or the router's
  (Router.held, with its counts), same moment (0);
- hung streams: streams without a terminal state by their deadline (or timeout_s, or
  --hang-s for those with neither) + --grace-s (0);
- wrong tokens: finished greedy streams not token-identical to HF greedy, and cut-short greedy
  streams not a prefix of it (0);
- failed: streams ended by an error status the client did not cause (0 unless --allow-failed);
- killed workers not replaced by a healthy one (0).
It also gives requests sent / finished / cancelled / past their deadline, TTFT and TPOT p50/p90/p99
(client side, finished streams), and the workers killed and replaced.

    python benchmarks/soak.py                                   # 30 minutes, a kill every 2-5 min
    python benchmarks/soak.py --duration-s 120 --kill-every-s 20,40 --rate 4
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from soak_cluster import SoakCluster
from soak_load import PlannedRequest, StreamResult, run_load

from loadgen.metrics import percentile

MAX_TOKENS = (1, 4, 8, 16, 32, 64, 128)
PROMPT_LENGTHS = (3, 5, 9, 17, 24, 33, 48, 64, 80, 100, 128, 150, 200, 256, 320, 400)


@dataclass(frozen=True)
class SoakSettings:
    duration_s: float = 1800.0
    kill_every_s: tuple[float, float] = (120.0, 300.0)  # a uniform interval between kills
    rate: float = 3.0  # requests/s (Poisson)
    seed: int = 0
    sampled_fraction: float = 0.25
    cancel_fraction: float = 0.25  # cancelled by the client: half at a uniform moment in [0, cancel_by_s),
    cancel_by_s: float = 0.5  # half after a uniform number of tokens in [1, max_tokens)
    grpc_deadline_fraction: float = 0.1  # a gRPC deadline, uniform in deadline_range_s
    timeout_fraction: float = 0.1  # GenerateRequest.timeout_s instead (the router ends it)
    deadline_range_s: tuple[float, float] = (0.02, 1.0)
    hang_s: float = 120.0  # a stream with no deadline must end within this
    grace_s: float = 5.0
    settle_s: float = 5.0
    quiet_end_s: float = 15.0
    max_concurrency: int = 128
    allow_failed: bool = False


@dataclass
class SoakReport:
    settings: SoakSettings
    results: list[StreamResult]
    kills: list[dict]
    pages_referenced: dict[str, int]
    ids_left: dict[str, list[str]]
    router_counts: dict[str, int]
    wall_s: float
    lines: list[str] = field(default_factory=list)

    def count(self, outcome: str) -> int:
        return sum(r.outcome == outcome for r in self.results)

    def failed(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.results:
            if r.outcome == "failed":
                out[r.status] = out.get(r.status, 0) + 1
        return out

    def wrong(self) -> tuple[list[StreamResult], list[StreamResult]]:
        """(finished greedy streams not HF-identical, cut-short greedy streams not a prefix of HF's)."""
        greedy = [r for r in self.results if not r.plan.sampled]
        finished = [r for r in greedy if r.outcome == "finished" and r.tokens != r.plan.reference]
        cut = [r for r in greedy if r.outcome != "finished" and r.tokens != r.plan.reference[: len(r.tokens)]]
        return finished, cut

    def failures(self) -> list[str]:
        """The invariants that do not hold, in words (empty: the soak passed)."""
        bad = []
        if leaked := sum(self.pages_referenced.values()):
            bad.append(f"{leaked} KV pages still referenced: {self.pages_referenced}")
        if any(self.ids_left.values()) or any(self.router_counts.values()):
            bad.append(f"request ids or counts left: {self.ids_left} {self.router_counts}")
        if hung := self.count("hung"):
            bad.append(f"{hung} hung streams")
        finished, cut = self.wrong()
        if finished or cut:
            bad.append(f"{len(finished)} finished greedy streams differ from HF, {len(cut)} cut-short ones are "
                       f"not a prefix of it (first: {(finished or cut)[0].describe()})")
        wrong_length = [r for r in self.results if r.outcome == "finished" and len(r.tokens) != r.plan.max_tokens]
        if wrong_length:
            bad.append(f"{len(wrong_length)} finished streams with a wrong token count ({wrong_length[0].describe()})")
        if self.failed() and not self.settings.allow_failed:
            bad.append(f"failed streams: {self.failed()}")
        if unreplaced := [k["worker_id"] for k in self.kills if k["replaced_s"] is None]:
            bad.append(f"killed workers not replaced: {unreplaced}")
        return bad

    def table(self) -> str:
        finished = [r for r in self.results if r.outcome == "finished"]
        ttft = [r.ttft_s for r in finished if r.ttft_s is not None]
        tpot = [r.tpot_s for r in finished if r.tpot_s is not None]
        wrong_finished, wrong_cut = self.wrong()
        replaced = [k for k in self.kills if k["replaced_s"] is not None]
        kills_by_role = ", ".join(f"{role} {sum(k['role'] == role for k in self.kills)}" for role in ("prefill", "decode"))
        replace_s = [k["replaced_s"] for k in replaced]
        rows = [
            ("wall time", f"{self.wall_s:.0f} s (load {self.settings.duration_s:.0f} s)"),
            ("requests sent", str(len(self.results))),
            ("finished", f"{len(finished)} (greedy {sum(not r.plan.sampled for r in finished)}, "
                         f"sampled {sum(r.plan.sampled for r in finished)})"),
            ("cancelled by the client", str(self.count("cancelled"))),
            ("past their deadline (DEADLINE_EXCEEDED)", str(self.count("deadline"))),
            ("failed, by status code", ", ".join(f"{k} {v}" for k, v in sorted(self.failed().items())) or "0"),
            ("hung streams", str(self.count("hung"))),
            ("pages leaked (referenced after settling)", str(sum(self.pages_referenced.values()))),
            ("request ids left (workers + router)", str(sum(len(v) for v in self.ids_left.values()))),
            ("finished greedy not HF-identical", f"{len(wrong_finished)} of {sum(not r.plan.sampled for r in finished)}"),
            ("cut-short greedy not a prefix of HF", str(len(wrong_cut))),
            ("TTFT p50/p90/p99 (ms)", "/".join(f"{1000 * percentile(ttft, p):.0f}" for p in (50, 90, 99))),
            ("TPOT p50/p90/p99 (ms)", "/".join(f"{1000 * percentile(tpot, p):.1f}" for p in (50, 90, 99))),
            ("workers killed (SIGKILL)", f"{len(self.kills)} ({kills_by_role})"),
            ("workers replaced (healthy at the router)",
             f"{len(replaced)}" + (f" (in {min(replace_s):.1f}-{max(replace_s):.1f} s)" if replace_s else "")),
        ]
        return "\n".join(["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


def prompt_pool(seed: int) -> list[list[int]]:
    """Fixed token-id prompts of PROMPT_LENGTHS, BOS first (builtin:tiny: vocabulary 4096, BOS 0, EOS 1)."""
    rng = random.Random(seed)
    return [[0] + [rng.randrange(2, 4096) for _ in range(n - 1)] for n in PROMPT_LENGTHS]


def hf_references(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Hugging Face transformers' greedy `generate()` of each prompt in float32, EOS ignored."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    refs, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model's steps: 4x faster on one thread than on two here
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=None)
            refs.append(out[0, len(p):].tolist())
    torch.set_num_threads(threads)
    return refs


def plan_requests(s: SoakSettings, prompts: list[list[int]], refs: list[list[int]]) -> list[PlannedRequest]:
    """The whole run's requests, seeded: arrival, prompt, max_tokens, sampling and how each ends."""
    rng = random.Random(s.seed)
    plan: list[PlannedRequest] = []
    at = rng.expovariate(s.rate)
    while at < s.duration_s:
        i, n = rng.randrange(len(prompts)), rng.choice(MAX_TOKENS)
        sampled = rng.random() < s.sampled_fraction
        end = rng.random()
        cancel_at = cancel_after = grpc_deadline = timeout = None
        if end < s.cancel_fraction / 2:  # at a moment: queued, prefilling, in transfer or decoding
            cancel_at = rng.uniform(0, s.cancel_by_s)
        elif end < s.cancel_fraction:  # mid-decode, after a random number of its tokens
            cancel_after = rng.randrange(1, n) if n > 1 else None
        elif end < s.cancel_fraction + s.grpc_deadline_fraction:
            grpc_deadline = rng.uniform(*s.deadline_range_s)
        elif end < s.cancel_fraction + s.grpc_deadline_fraction + s.timeout_fraction:
            timeout = rng.uniform(*s.deadline_range_s)
        plan.append(PlannedRequest(len(plan), at, prompts[i], n, refs[i][:n], sampled, rng.randrange(1 << 31),
                                   cancel_at, cancel_after, grpc_deadline, timeout))
        at += rng.expovariate(s.rate)
    return plan


def run_soak(s: SoakSettings, work_dir: Path, say=print) -> SoakReport:
    """Runs the whole soak (the cluster is always stopped before this returns)."""
    import time

    from engine.model.builtin import ensure_builtin

    start = time.monotonic()

    def stamped(line: str) -> None:
        say(f"[{time.monotonic() - start:7.1f} s] {line}")

    prompts = prompt_pool(s.seed)
    stamped(f"soak: HF greedy references for {len(prompts)} prompts ({max(MAX_TOKENS)} tokens each), "
            "while the cluster starts")
    with ThreadPoolExecutor(1) as oracle, SoakCluster(work_dir, say=stamped) as cluster:
        refs_future = oracle.submit(hf_references, ensure_builtin("tiny"), prompts, max(MAX_TOKENS))
        cluster.start()
        plan = plan_requests(s, prompts, refs_future.result())
        stamped(f"soak: cluster up at {cluster.grpc_address}, references ready; {len(plan)} requests over "
                f"{s.duration_s:.0f} s, a kill every {s.kill_every_s[0]:g}-{s.kill_every_s[1]:g} s")
        killer = cluster.start_killing(s.kill_every_s, s.duration_s - s.quiet_end_s, random.Random(s.seed + 1))
        results = run_load(cluster.grpc_address, plan, s.hang_s, s.grace_s, s.max_concurrency)
        stamped(f"soak: load done ({len(results)} streams ended); waiting for the last replacement")
        kills = killer.finish()
        pages, ids, counts = cluster.settle(s.settle_s)
        stamped("soak: stopping the cluster")
    stamped("soak: cluster stopped")
    return SoakReport(s, results, kills, pages, ids, counts, time.monotonic() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=1800.0, help="seconds of load (default 1800)")
    parser.add_argument("--kill-every-s", default="120,300",
                        help="LO,HI: seconds between SIGKILLs, uniform (default 120,300); 0,0 = no kills")
    parser.add_argument("--rate", type=float, default=3.0, help="requests/s, Poisson (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the requests and the kills (default 0)")
    parser.add_argument("--sampled-fraction", type=float, default=0.25, help="requests sampled, not greedy (0.25)")
    parser.add_argument("--cancel-fraction", type=float, default=0.25,
                        help="requests the client cancels (0.25): half at a random moment within --cancel-by-s "
                             "of sending, half after a random number of their tokens")
    parser.add_argument("--cancel-by-s", type=float, default=0.5,
                        help="latest time-based cancel after sending (default 0.5: a request here lives ~0.02-1 s)")
    parser.add_argument("--hang-s", type=float, default=120.0,
                        help="a stream with no deadline that has not ended by then is hung (default 120)")
    parser.add_argument("--grace-s", type=float, default=5.0, help="beyond a deadline before a stream is hung (5)")
    parser.add_argument("--settle-s", type=float, default=5.0,
                        help="after the last stream, pages and ids must be free within this (default 5)")
    parser.add_argument("--allow-failed", action="store_true", help="error statuses do not fail the run")
    parser.add_argument("--work-dir", type=Path, default=None, help="config, state and logs (default: a temp dir)")
    args = parser.parse_args()
    lo, hi = (float(x) for x in args.kill_every_s.split(","))
    if not 0 <= lo <= hi:
        parser.error("--kill-every-s wants LO,HI with 0 <= LO <= HI")
    settings = SoakSettings(duration_s=args.duration_s, kill_every_s=(lo, hi), rate=args.rate, seed=args.seed,
                            sampled_fraction=args.sampled_fraction, cancel_fraction=args.cancel_fraction,
                            cancel_by_s=args.cancel_by_s, hang_s=args.hang_s, grace_s=args.grace_s,
                            settle_s=args.settle_s, allow_failed=args.allow_failed)
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="pdserve-soak-"))
    report = run_soak(settings, work_dir, say=lambda line: print(line, flush=True))
    print("\n" + report.table())
    bad = report.failures()
    for line in bad:
        print(f"FAILED: {line}")
    print("soak: every invariant held" if not bad else f"soak: {len(bad)} invariant(s) failed")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
