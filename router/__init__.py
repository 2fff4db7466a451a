"""Router: the public gRPC/HTTP front door, tokenizer and pair-selection policy (arrives with the disaggregation issue)."""
