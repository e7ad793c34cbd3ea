"""What the GPU machine offers for the CUDA attention path, and how fast: one JSON file.

Records the torch / Triton / transformers versions, the signatures of ``varlen_attn`` and
``aten._flash_attention_forward`` (their arguments differ between torch 2.11 and 2.13, so the
package gates on features), and times the attention forms the package needs at Gemma shapes
(bf16, 8 query heads, 2 KV heads, head dim 256): full causal prefill, sliding window, and the
query-subset form (R queries against all keys, bottom-right causal). Each kernel is checked
against a float32 reference first. The split-KV Triton kernel of the query-subset form is timed
beside FlashAttention's.

    PYTHONPATH=. python3 benchmarks/probe_cuda.py --out results.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import statistics
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import repeat_ms  # noqa: E402
from fx_fastprefill.ops.kernels.split_kv import HAS_TRITON, split_kv_attention  # noqa: E402


def timed_ms(fn) -> float:
    """Median of 10 timed calls after 3 warm-up calls."""
    return statistics.median(repeat_ms(fn, runs=10))


def reference(q, k, v, q_pos, k_len, window=None):
    """q [R, H, D] at absolute positions q_pos against k, v [K, Hkv, D]; float32."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, 1)
    vf = v.float().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kf) / math.sqrt(q.shape[-1])
    kp = torch.arange(k_len, device=q.device)
    allowed = kp[None] <= q_pos[:, None]
    if window is not None:
        allowed &= kp[None] > q_pos[:, None] - window
    s = s.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vf)


def flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, window=None):
    """aten._flash_attention_forward: FlashAttention-2 varlen; causal is bottom-right aligned."""
    left = -1 if window is None else window - 1
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=1 / math.sqrt(q.shape[-1]),
        window_size_left=left, window_size_right=0)
    return out[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name()}
    try:
        import triton
        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None
    try:
        import transformers
        result["transformers"] = transformers.__version__
        result["has_gemma3n"] = hasattr(transformers, "Gemma3nForCausalLM")
        result["has_gemma4"] = hasattr(transformers, "Gemma4ForCausalLM")
    except ImportError:
        result["transformers"] = None
    try:
        from torch.nn.attention.varlen import varlen_attn
        result["varlen_attn_signature"] = str(inspect.signature(varlen_attn))
    except Exception as e:  # noqa: BLE001 - recording what is there
        result["varlen_attn_signature"] = f"unavailable: {e}"
    result["flash_forward_schema"] = str(torch.ops.aten._flash_attention_forward.default._schema)

    dev, dt = "cuda", torch.bfloat16
    H, HKV, D = 8, 2, 256
    torch.manual_seed(0)
    checks, timings = {}, []
    for seqs, seq_len in ((1, 8192), (8, 4096), (1, 32768), (64, 512)):
        T = seqs * seq_len
        q = torch.randn(T, H, D, device=dev, dtype=dt)
        k = torch.randn(T, HKV, D, device=dev, dtype=dt)
        v = torch.randn(T, HKV, D, device=dev, dtype=dt)
        cu = torch.arange(0, T + 1, seq_len, device=dev, dtype=torch.int32)
        last = cu[1:].long() - 1
        cu_r = torch.arange(0, seqs + 1, device=dev, dtype=torch.int32)
        shape = f"{seqs}x{seq_len}"
        for window in (None, 512):
            tag = f"{shape}/{'full' if window is None else 'sw512'}"
            try:
                # correctness on the last sequence's last 64 rows, and the query-subset form
                out = flash_varlen(q, k, v, cu, cu, seq_len, seq_len, window)
                rows = torch.arange(T - 64, T, device=dev)
                ref = reference(q[rows], k[T - seq_len:], v[T - seq_len:], rows - (T - seq_len), seq_len, window)
                checks[f"full {tag}"] = (out[rows].float() - ref).abs().max().item()
                sub = flash_varlen(q[last], k, v, cu_r, cu, 1, seq_len, window)
                ref = reference(
                    q[last[-1:]],
                    k[T - seq_len :],
                    v[T - seq_len :],
                    torch.tensor([seq_len - 1], device=dev),
                    seq_len,
                    window,
                )
                checks[f"query_subset {tag}"] = (sub[-1:].float() - ref).abs().max().item()
                timings.append({"shape": shape, "window": window, "form": "flash_varlen_gqa",
                                "ms": timed_ms(lambda: flash_varlen(q, k, v, cu, cu, seq_len, seq_len, window))})
                kr, vr = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
                timings.append({"shape": shape, "window": window, "form": "flash_varlen_repeated_kv",
                                "ms": timed_ms(lambda: flash_varlen(q, kr, vr, cu, cu, seq_len, seq_len, window))})
                timings.append(
                    {
                        "shape": shape,
                        "window": window,
                        "form": "repeat_kv_alone",
                        "ms": timed_ms(lambda: (k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1))),
                    }
                )
                timings.append({"shape": shape, "window": window, "form": "query_subset_R=seqs",
                                "ms": timed_ms(lambda: flash_varlen(q[last], k, v, cu_r, cu, 1, seq_len, window))})
                if HAS_TRITON:
                    starts, lens = cu[:-1].clone(), torch.full((seqs,), seq_len, device=dev, dtype=torch.int32)
                    pos = lens - 1
                    split = split_kv_attention(q[last], k, v, starts, lens, pos, 1 / math.sqrt(D), window, seq_len)
                    ref = reference(
                        q[last[-1:]],
                        k[T - seq_len :],
                        v[T - seq_len :],
                        torch.tensor([seq_len - 1], device=dev),
                        seq_len,
                        window,
                    )
                    checks[f"split_kv {tag}"] = (split[-1:].float() - ref).abs().max().item()
                    timings.append(
                        {
                            "shape": shape,
                            "window": window,
                            "form": "split_kv_R=seqs",
                            "ms": timed_ms(
                                lambda: split_kv_attention(
                                    q[last], k, v, starts, lens, pos, 1 / math.sqrt(D), window, seq_len
                                )
                            ),
                        }
                    )
                if window is None and seqs == 1:
                    qb, kb, vb = (x.transpose(0, 1)[None] for x in (q, kr, vr))
                    timings.append({"shape": shape, "window": None, "form": "sdpa_dense_causal",
                                    "ms": timed_ms(lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True))})
            except Exception:  # noqa: BLE001 - recorded, the probe goes on
                checks[tag] = traceback.format_exc(limit=3)
        q = k = v = None  # free before the next shape
    result["max_abs_error_vs_fp32"] = checks
    result["timings"] = timings
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
