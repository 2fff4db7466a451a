"""The compiled CPU ops (kernels/cpu/*.cpp), built on first use.

The CPU serving path of engine/model/attention.py: `paged_attention` attends a whole mixed batch
(decode rows and prefill chunks) reading K/V pages in place, `store_kv` scatters a step's K/V
into its slots; both take the arguments of their kernels/reference.py twins, which stay the
oracle in tests and the fallback when no compiler is at hand. `skinny_linear` is x W^T (+ b)
for the few-row activations of decode steps, where BLAS streams the weights at half speed.

The extension is compiled once per source, torch version and CPU (`-O3 -march=native`, so a
cache built on one processor is never loaded on another) into `PDSERVE_EXT_DIR` (default
~/.cache/pdserve/ext). `load()` returns None, with the reason kept in `load_error()`, when the
build fails; callers then use the torch ops.

torch's builder guards a build directory with a `lock` file that a killed build leaves behind,
and every later load (cached or not) then waits on it forever. pdserve processes take an
flock of their own around the load (`_build_guard`): the kernel drops it when its holder dies,
so whoever holds it knows any `lock` file there is a dead build's, and removes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "cpu"
SOURCES = [SOURCE_DIR / name for name in ("module.cpp", "paged_attention.cpp", "skinny_linear.cpp", "fused_ops.cpp",
                                                "packed_gemv.cpp", "decode_layers.cpp",
                                                "greedy_steps.cpp")]
HEAD_DIMS = (16, 32, 48, 64, 80, 96, 128, 256)  # the head sizes the kernel is compiled for
_lock = threading.Lock()
_module: ModuleType | None = None
_error: str | None = None


def _cpu_signature() -> str:
    """What the compiled code depends on: the processor's flags and model, torch's version."""
    flags = model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = line
            elif line.startswith("model name") and not model:
                model = line
    except OSError:
        pass
    return f"{platform.machine()}|{model}|{flags}|{torch.__version__}"


def build_dir() -> Path:
    root = Path(os.environ.get("PDSERVE_EXT_DIR") or Path.home() / ".cache" / "pdserve" / "ext")
    digest = hashlib.sha256()
    for path in sorted(SOURCE_DIR.iterdir()):  # every source and header
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(_cpu_signature().encode())
    return root / digest.hexdigest()[:16]


def load(verbose: bool = False) -> ModuleType | None:
    """The compiled module (built here first if needed), or None if it cannot be built."""
    global _module, _error
    with _lock:
        if _module is not None or _error is not None:
            return _module
        try:
            from torch.utils.cpp_extension import load as load_extension

            directory = build_dir()
            directory.mkdir(parents=True, exist_ok=True)
            with _build_guard(directory):
                _module = load_extension(
                    name="pdserve_cpu_attention",
                    sources=[str(p) for p in SOURCES],
                    build_directory=str(directory),
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
                    extra_ldflags=["-fopenmp"],
                    verbose=verbose,
                )
        except Exception as exc:  # noqa: BLE001 - a missing compiler or ninja: serve on the torch path instead
            _error = f"{type(exc).__name__}: {exc}".strip()[:2000]
        return _module


@contextlib.contextmanager
def _build_guard(directory: Path) -> Iterator[None]:
    """Held while this process loads (and maybe builds) the extension in `directory`: one pdserve
    process at a time, the others wait here; a torch `lock` file found while holding it was left by
    a build that died (every live one holds this flock), so it is removed instead of waited on."""
    with open(directory / "pdserve-build.flock", "a+") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # released by the kernel if the holder is killed
        stale = directory / "lock"
        if stale.exists():
            log.warning("removing %s: a build of the CPU ops was killed before it finished", stale)
            stale.unlink(missing_ok=True)
        yield


def load_error() -> str | None:
    """Why `load()` returned None (None if it has not failed)."""
    return _error


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences packed back to back
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # [num_seqs, max_pages] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, tokens in the cache incl. this step's
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of every query token over its sequence's pages, in one call."""
    return _require().paged_attention(query, k_cache, v_cache, page_table, query_start_loc, context_lens, scale)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence ([num_seqs, num_heads, head_dim]), with the arguments of
    kernels.reference.paged_decode_attention: `paged_attention` with one-token sequences."""
    starts = torch.arange(query.shape[0] + 1, dtype=torch.int32)
    return paged_attention(query, k_cache, v_cache, page_table, starts, context_lens, scale)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter each token's key/value into its slot (negative slots are skipped), in place."""
    _require().store_kv(key, value, k_cache, v_cache, slot_mapping)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for x [M, K] with few rows M and K a multiple of 8; weight [N, K]."""
    return _require().skinny_linear(x, weight, bias)


def packed_gemv_supported() -> bool:
    """Whether `packed_gemv` was built (it needs AVX512-BF16)."""
    return _require().packed_gemv_supported()


def int8_gemv_supported() -> bool:
    """Whether `packed_gemv` takes int8 weights (kernels/packed_linear.py quantize_int8: AVX512-VNNI
    and AVX512-BF16)."""
    return _require().int8_gemv_supported()


def amx_attention_supported() -> bool:
    """Whether `paged_attention` multiplies bf16 prefill tiles on AMX (kernels/cpu/prefill_tile_amx.h):
    built for a CPU with AMX, and Linux granted this process the tile registers."""
    return _require().amx_attention_supported()


def shared_prefix_attention_supported() -> bool:
    """Whether `paged_attention` attends bf16 decode tokens sharing cached prefix pages as one group
    (kernels/cpu/shared_prefix.h): built for a CPU with AVX512-BF16 (AMX tiles where granted)."""
    return _require().shared_prefix_attention_supported()


def packed_gemv_amx_supported() -> bool:
    """Whether `packed_gemv` multiplies 2-32 rows over the 32 x 32 layout on AMX tiles."""
    return _require().packed_gemv_amx_supported()


def packed_gemv(x: torch.Tensor, blocked: torch.Tensor, n: int, bias: torch.Tensor | None = None,
                block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    """x [M <= 8, or <= 32 on AMX, K] bf16 times a weight [n, K] held in oneDNN's blocked bf16 layout (`blocked`: a
    flat bf16 view of its bytes; blocks of `block_n` outputs, tiles of `block_k` inputs, see
    kernels/cpu/packed_gemv.cpp; kernels/packed_linear.py finds which); returns [M, n] bf16."""
    return _require().packed_gemv(x, blocked, n, bias, block_n, block_k)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual += x, then x = rms_norm(residual) * weight (rows of [T, H])."""
    _require().add_rms_norm_(x, residual, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x) * weight for rows of a contiguous [T, H], in add_rms_norm_'s formula."""
    return _require().rms_norm(x, weight, eps)


def rotary_(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            num_rotated_heads: int) -> None:
    """In place: the first `num_rotated_heads` heads of each [T, heads, d] row (queries, then
    keys) rotated by their position's row of the float32 cos/sin tables [max_positions, d]."""
    _require().rotary_(qkv, positions, cos, sin, num_rotated_heads)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows [gate | up] of [T, 2 * I]; returns [T, I]."""
    return _require().silu_mul(gate_up)


def decode_layers(*args: object) -> torch.Tensor:
    """A step's decoder layers over packed GEMVs in one call (kernels/cpu/decode_layers.cpp; its
    arguments are laid out by engine/model/fused_decode.py, the one caller)."""
    return _require().decode_layers(*args)


def greedy_steps(*args: object) -> torch.Tensor:
    """A draft's greedy one-token steps, each feeding the previous argmax, in one call
    (kernels/cpu/greedy_steps.cpp; its arguments are laid out by engine/spec/fused_draft.py)."""
    return _require().greedy_steps(*args)


def _require() -> ModuleType:
    module = load()
    if module is None:
        raise RuntimeError(f"the CPU attention extension could not be built: {_error}")
    return module


if __name__ == "__main__":  # `python -m kernels.cpu_ops`: build now (the install step does)
    import time

    start = time.perf_counter()
    built = load(verbose=False)
    if built is None:
        raise SystemExit(f"CPU attention extension not built: {_error}")
    print(f"CPU attention extension ready in {build_dir()} ({time.perf_counter() - start:.1f} s)")
