"""The model a step runs: HF config -> `ModelConfig` (config.py), dtype choice (compute_dtype.py),
weights from disk or a built-in checkpoint (loader.py, builtin.py), and the decoder itself
(llama.py: one class for Llama, Mistral and Qwen2) over its layers (layers.py), rotary
embeddings (rope.py) and paged attention (attention.py, dispatching to kernels/)."""
