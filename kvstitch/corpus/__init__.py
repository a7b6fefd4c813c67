"""Applications over a document collection: indexing and retrieval (`retrieval`, its embedder `embedding`),
distributed precompute with Ray (`ray_precompute`)."""
