"""Wire contracts between processes (.proto files and generated code arrive with the disaggregation issue)."""
