"""The Runner's request table (runtime/requests.py): one owner for which request holds which KV region."""

import pytest
import torch

from fx_fastprefill.ops.kv_cache import KVCache
from fx_fastprefill.runtime.batch import Request
from fx_fastprefill.runtime.requests import RequestTable
from tests.helpers import small_model


def table(regions=2):
    return RequestTable(KVCache(regions, 8, torch.device("cpu"), torch.float32, padding_slots=0))


def test_admit_free_and_ids():
    requests = table()
    first = requests.admit(Request(requests.new_id(), [1, 2], 3, -1))
    assert first.seq_id == 0 and first.slot_base >= 0 and 0 in requests and requests.free_regions == 1
    requests.admit_new([5, 5])  # a step naming one new request twice admits it once
    assert list(requests) == [0, 5] and requests.free_regions == 0
    with pytest.raises(ValueError, match="live already"):
        requests.admit(Request(5, [], 0, -1))
    with pytest.raises(RuntimeError, match="no free KV cache region"):
        requests.admit(Request(requests.new_id(), [], 0, -1))
    requests.free(5)
    with pytest.raises(KeyError, match="no live request 5"):
        requests.free(5)
    assert requests.new_id() not in requests and len(requests) == 1


def test_a_step_that_names_too_many_new_requests_admits_none():
    requests = table(regions=2)
    requests.admit_new([0])
    with pytest.raises(RuntimeError, match="2 new requests but only 1 free"):
        requests.admit_new([0, 1, 2])
    assert list(requests) == [0] and requests.free_regions == 1


def test_the_scheduler_admits_through_the_runners_table_and_frees_every_request():
    import fx_fastprefill
    runner = fx_fastprefill.Runner(small_model(), max_num_tokens=16, max_model_len=32, max_num_seqs=2)
    runner.step([fx_fastprefill.SeqChunk(1, [3, 4, 5])])  # a request of the caller's own: id 1 is taken
    finished = runner.generate([[1, 2], [3, 4, 5], [6]], 2)
    assert len(finished) == 3 and list(runner.requests) == [1]  # the scheduler's requests all freed
