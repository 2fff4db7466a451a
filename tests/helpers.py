"""Test helpers: the Hugging Face greedy reference, the page-accounting check, and a stand-in for
device memory on a machine without a GPU."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Hugging Face greedy generate (EOS ignored): generated ids and each one's log-probability."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=None, output_logits=True, return_dict_in_generate=True,
        )
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def assert_no_page_leak(engine) -> None:
    """Every page is free or held only by the prefix cache."""
    stats = engine.page_stats()
    # Two independent views: the per-page reference counts, and the free/evictable pools.
    held = [page for page, refs in enumerate(engine.page_manager.ref_counts) if refs]
    assert not held, f"pages still referenced after all requests finished: {held[:10]} ({stats})"
    assert stats["free"] == stats["num_pages"], stats


def prefill_and_ship(prefill, decode, request_id: str, prompt: list[int]) -> int:
    """Runs the prefill role and the page copy for one request; returns the first token."""
    res = decode.handoff.reserve(request_id, prompt)
    assert res is not None
    prefill.add_request(request_id, prompt, SamplingParams(max_tokens=1, ignore_eos=True), hold_kv=True)
    first = None
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            first = out.new_token_ids[0]
    held = prefill.handoff.held(request_id)
    assert held.num_tokens == len(prompt)
    skip = res.num_cached_pages  # the decode side already has these pages: send only the rest
    decode.kv_cache.write_pages(list(res.page_ids[skip:]), prefill.kv_cache.read_pages(list(held.page_ids[skip:])))
    prefill.handoff.release(request_id)
    return first


def listening_addresses(port: int) -> set[str]:
    """The local addresses of every TCP socket listening on `port` on this machine ("0.0.0.0" or
    "::" when one listens on every interface), read from /proc/net/tcp{,6}: no `ss` needed."""
    import ipaddress

    found = set()
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            lines = open(table).read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            # The kernel prints each 32-bit word of the address in host (little-endian) order.
            raw = b"".join(bytes.fromhex(address[i : i + 8])[::-1] for i in range(0, 2 * width, 8))
            found.add(str(ipaddress.ip_address(raw)))
    return found


class DeviceTensor(torch.Tensor):
    """A tensor that behaves, for the transport, as one in GPU memory does: it says it lives on
    `cuda` and refuses `.numpy()` until copied to the host (what CUDA tensors raise)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.numpy.__get__ or getattr(func, "__name__", "") == "numpy":
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() first.")
        out = super().__torch_function__(func, types, args, kwargs or {})
        if getattr(func, "__name__", "") in ("cpu", "to"):  # the host copy is a plain tensor
            return out.as_subclass(torch.Tensor) if isinstance(out, torch.Tensor) else out
        return out

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)


# builtin:tiny is random and never repeats itself, so prompt lookup would never be right on it.
# Scaling its decoder layers' weights down lets the tied embedding dominate: greedy output then
# falls into repeats with context-dependent breaks (at 0.36, measured: over 100 tokens, 12-37
# proposals per request, 30-90% accepted), while attention still shapes every token.
LOOPY_LAYER_SCALE = 0.36


def write_loopy_model(src, dst, scale: float = LOOPY_LAYER_SCALE) -> None:
    """A copy of the checkpoint at `src` with its decoder layers' projections scaled down (at 0 the
    layers add nothing: the tied embedding makes greedy output repeat the prompt's last token)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    [weights] = list(dst.glob("*.safetensors"))
    tensors = {name: t * scale if "layers." in name and "norm" not in name else t
               for name, t in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})


def write_truncated_model(src, dst, num_layers: int, vocab_size: int | None = None) -> None:
    """A copy of the checkpoint at `src` keeping only its first `num_layers` decoder layers (a
    cheaper model that agrees with `src` often: a draft for it), and optionally only the first
    `vocab_size` rows of its embedding (a draft with the wrong vocabulary)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    [weights] = list(dst.glob("*.safetensors"))
    tensors = {name: t for name, t in load_file(weights).items()
               if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers}
    config = json.loads((dst / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    if vocab_size is not None:
        tensors = {name: t[:vocab_size] if "embed_tokens" in name or "lm_head" in name else t
                   for name, t in tensors.items()}
        config["vocab_size"] = vocab_size
    save_file(tensors, weights, metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def medusa_tensors_from_lm_head(model_dir, num_heads: int, num_layers: int = 1) -> dict[str, torch.Tensor]:
    """Medusa-1 tensors (`{head}.{layer}.linear.*`, `{head}.{num_layers}.weight`) whose every head is
    the model's own output layer behind identity blocks: each guesses that the token the model just
    produced comes again (always right for a model that repeats itself, sometimes for a loopy one)."""
    from safetensors.torch import load_file

    weights = load_file(str(next(iter(sorted(model_dir.glob("*.safetensors"))))))
    output = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])  # [vocab, hidden]
    hidden = output.shape[1]
    tensors = {}
    for i in range(num_heads):
        for j in range(num_layers):
            tensors[f"{i}.{j}.linear.weight"] = torch.zeros(hidden, hidden)
            tensors[f"{i}.{j}.linear.bias"] = torch.zeros(hidden)
        tensors[f"{i}.{num_layers}.weight"] = output.clone()
    return tensors


def write_medusa_heads(dst, tensors: dict[str, torch.Tensor], num_heads: int, num_layers: int = 1,
                       file: str = "medusa_lm_head.safetensors", prefix: str = ""):
    """Writes `tensors` in Medusa's published layout: config.json and the weights `file` (.safetensors,
    or .pt via torch.save), each name behind `prefix` ("medusa_head." for Medusa-2 style)."""
    import json

    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    named = {prefix + name: t for name, t in tensors.items()}
    if file.endswith(".pt"):
        torch.save(named, dst / file)
    else:
        save_file(named, str(dst / file), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps({"medusa_num_heads": num_heads, "medusa_num_layers": num_layers}))
    return dst
