"""fx_fastprefill::sdpa: SDPA's own semantics unless the call runs on a query suffix."""

import torch
import torch.nn.functional as F

from fx_fastprefill.ops import sdpa as _sdpa_kernels  # noqa: F401  (the op's kernel and fake kernel)

sdpa = torch.ops.fx_fastprefill.sdpa.default


def test_fake_kernel_and_real_kernel_agree():
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    torch.library.opcheck(sdpa, (q, k, v, None, 0.0, True, None, True, "layer", True))
    torch.library.opcheck(sdpa, (q, k[:, :, :5], v[:, :, :5], None, 0.0, True, None, True, "layer", False))


def test_query_suffix_is_bottom_right_causal():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    last3 = sdpa(q[:, :, -3:], k, v, None, 0.0, True, None, True, "layer", True)
    torch.testing.assert_close(last3, full[:, :, -3:])
    # with a mask as well (padding on the left of the first sequence)
    mask = torch.ones(2, 1, 9, 9, dtype=torch.bool).tril()
    mask[0, :, :, :2] = False
    mask[0, :, :2, 0] = True  # keep every row attending somewhere
    full = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    last3 = sdpa(q[:, :, -3:], k, v, mask[:, :, -3:], 0.0, False, None, True, "layer", True)
    torch.testing.assert_close(last3, full[:, :, -3:])


def test_without_query_suffix_it_is_sdpa():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    # top-left causal, exactly as F.scaled_dot_product_attention does for Lq != Lk
    torch.testing.assert_close(sdpa(q, k, v, None, 0.0, True, None, False, "layer", False),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_suffix_of_top_left_causal_over_more_keys():
    """A static cache's prefill: 6 queries from position 0 against 10 key slots, top-left causal.
    The suffix call, told the full call had 6 queries, gives the full call's last rows."""
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    last2 = sdpa(q[:, :, -2:], k, v, None, 0.0, True, None, True, "layer", True, 6)
    torch.testing.assert_close(last2, full[:, :, -2:])
    torch.library.opcheck(sdpa, (q[:, :, -2:], k, v, None, 0.0, True, None, True, "layer", True, 6))
