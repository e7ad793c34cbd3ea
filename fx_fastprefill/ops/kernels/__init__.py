"""Attention kernels: the float32 reference, FlashAttention varlen packing, split-KV (Triton)."""
