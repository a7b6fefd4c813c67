"""Applications over a document collection: indexing and retrieval (`retrieval`), distributed precompute
with Ray (`ray_precompute`)."""
