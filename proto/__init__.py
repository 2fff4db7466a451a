"""Wire contracts: pdserve.proto (the public gRPC API) and its generated, committed Python code."""
