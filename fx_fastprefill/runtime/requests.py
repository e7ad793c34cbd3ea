"""The Runner's live requests: the one owner of which request holds which KV cache region.

A request is admitted once (a region allocated for it) and freed once (the region back); the
Runner's steps admit the requests a step names first, the scheduler (runtime/scheduler.py) the
requests it starts, both through :meth:`RequestTable.admit`."""

from __future__ import annotations

from typing import Iterator

from ..ops.kv_cache import KVCache
from .batch import Request


class RequestTable:
    """Live requests by id, each with its KV cache region (``Request.slot_base``)."""

    def __init__(self, kv_cache: KVCache):
        self.kv_cache = kv_cache
        self._live: dict[int, Request] = {}
        self._next_id = 0

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._live

    def __getitem__(self, seq_id: int) -> Request:
        return self._live[seq_id]

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._live))

    @property
    def free_regions(self) -> int:
        return self.kv_cache.free_regions

    def new_id(self) -> int:
        """An id no live request has (ids count up; one a caller chose is skipped)."""
        while self._next_id in self._live:
            self._next_id += 1
        self._next_id += 1
        return self._next_id - 1

    def admit(self, request: Request) -> Request:
        """``request`` live, with a KV cache region of its own."""
        if request.seq_id in self._live:
            raise ValueError(f"request {request.seq_id} is live already")
        if self.kv_cache.free_regions == 0:
            raise RuntimeError("no free KV cache region (max_num_seqs requests are live)")
        request.slot_base = self.kv_cache.allocate_region()
        self._live[request.seq_id] = request
        return request

    def admit_new(self, seq_ids: list[int]) -> None:
        """Each id not live yet admitted as a bare request (a step's chunk names it first), all or none."""
        new = [s for s in dict.fromkeys(seq_ids) if s not in self._live]
        if len(new) > self.kv_cache.free_regions:
            raise RuntimeError(
                f"{len(new)} new requests but only {self.kv_cache.free_regions} free KV cache regions (max_num_seqs)"
            )
        for seq_id in new:
            self.admit(Request(seq_id, [], 0, -1))

    def free(self, seq_id: int) -> None:
        """Release a request's KV cache region."""
        request = self._live.pop(seq_id, None)
        if request is None:
            raise KeyError(f"no live request {seq_id}")
        self.kv_cache.free_region(request.slot_base)
