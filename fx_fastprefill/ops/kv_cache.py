"""KV cache storage: one slot array per layer that owns a cache.

Each live request owns a contiguous region of ``max_model_len`` slots, so a request's keys are a
plain slice of the array (no block table): simple on the CPU, and directly usable by
variable-length kernels that take contiguous K/V. Layers that read another layer's cache
(KV sharing) own no array.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_regions: int, region_len: int, device: torch.device | str, dtype: torch.dtype,
                 padding_slots: int = 0):
        self.num_regions = num_regions
        self.region_len = region_len
        # Slots after the last region, for the rows that pad a step up to a captured size.
        self.padding_slots = padding_slots
        self.device = torch.device(device)
        self.dtype = dtype
        self.keys: dict[str, torch.Tensor] = {}
        self.values: dict[str, torch.Tensor] = {}
        # Step in which each layer last wrote its cache: a sharing layer that reads a source which
        # has not run yet in this step gets an error instead of stale keys.
        self.last_write_step: dict[str, int] = {}
        self._free_regions = list(range(num_regions - 1, -1, -1))

    @property
    def num_slots(self) -> int:
        return self.num_regions * self.region_len + self.padding_slots

    @property
    def padding_base(self) -> int:
        """First slot of the padding rows' region."""
        return self.num_regions * self.region_len

    def allocate_region(self) -> int:
        """Reserve a region for a new request; returns its first slot."""
        if not self._free_regions:
            raise RuntimeError(
                f"KV cache full: all {self.num_regions} request regions are in use "
                "(raise max_num_seqs or free finished requests)"
            )
        return self._free_regions.pop() * self.region_len

    def free_region(self, slot_base: int) -> None:
        region = slot_base // self.region_len
        if region in self._free_regions:
            raise RuntimeError(f"KV cache region starting at slot {slot_base} freed twice")
        self._free_regions.append(region)

    @property
    def free_regions(self) -> int:
        return len(self._free_regions)

    def layer_arrays(self, layer: str, num_kv_heads: int, head_dim: int, v_head_dim: int):
        """The (keys, values) arrays of ``layer``, allocated on its first write."""
        if layer not in self.keys:
            self.keys[layer] = torch.zeros(self.num_slots, num_kv_heads, head_dim, device=self.device, dtype=self.dtype)
            self.values[layer] = torch.zeros(
                self.num_slots, num_kv_heads, v_head_dim, device=self.device, dtype=self.dtype
            )
        keys, values = self.keys[layer], self.values[layer]
        if keys.shape[1:] != (num_kv_heads, head_dim) or values.shape[1:] != (num_kv_heads, v_head_dim):
            raise ValueError(
                f"layer {layer!r} writes K/V of shape [*, {num_kv_heads}, {head_dim}] / [*, {num_kv_heads}, "
                f"{v_head_dim}] "
                f"but its cache holds {list(keys.shape[1:])} / {list(values.shape[1:])}"
            )
        return keys, values

    def source_arrays(self, kv_source: str, reader: str):
        if kv_source not in self.keys:
            known = ", ".join(sorted(self.keys)) or "none"
            raise ValueError(
                f"attention layer {reader!r} names kv_source={kv_source!r}, but no layer of that name owns a KV cache "
                f"(layers with a cache: {known}); kv_source must name an earlier layer that computes its own K/V"
            )
        return self.keys[kv_source], self.values[kv_source]
