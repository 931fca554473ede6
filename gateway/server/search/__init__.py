"""Similarity search: embed the query through Triton, ask a binder's vector index for the
nearest stored results, and return them with their records."""
