"""Attention kernels for the paged KV cache.

`kernels.reference` holds the pure-torch ops (the CPU serving path and the test oracle); the
Triton kernels beside it (`kernels.triton_store_kv`, `kernels.triton_decode_attention`,
`kernels.triton_prefill_attention`) are the GPU path with the same signatures; the jit helpers
and argument checks they share live in `kernels.triton_paged_common`. Triton is imported only by
those modules, so CPU users never need it. Imports nothing from the project.
"""
