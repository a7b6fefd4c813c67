"""Core (foundations): typed errors, chunk K/V, RoPE re-rotation, the stitched cache, prompt layout, the
attention kernel, chunking and model/tokenizer identity."""
