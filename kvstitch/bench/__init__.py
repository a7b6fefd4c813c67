"""Benchmarks: TTFT (`ttft`), the server under load (`serve`), precompute (`precompute`), chunk stores
(`store`), sparse decode on a real model (`decode`) and on synthetic K/V (`decode_synthetic`)."""
