"""Running a flat-batch model step by step: the Runner, step batches, the KV cache, step metadata."""
