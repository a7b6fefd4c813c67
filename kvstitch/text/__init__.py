"""Text before it becomes tokens' K/V: splitting documents into chunks (`chunking`) and ranking passages against a
question by BM25 (`bm25`; retrieval's fallback and the adaptive budget's verification)."""
