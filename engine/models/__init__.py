"""Model implementations served by the engine (one decoder covers Llama, Mistral and Qwen2)."""
