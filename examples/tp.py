"""Tensor parallelism for the flat example models: shard a built model in place, Megatron style.

Every rank builds the same full model (same seed), then keeps its share: attention heads and MLP
columns are split over the ranks (q/k/v and gate/up column-parallel), the output projections are
row-parallel and followed by a functional ``all_reduce`` (a forward hook, which torch.compile traces
into the graph as ``_c10d_functional.all_reduce`` + ``wait_tensor``). Embeddings, norms and the LM
head stay replicated. KV-sharing layers keep reading their source layer's cache, which now holds
this rank's K/V heads.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

if not __package__:  # run as a script: make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.blocks import MLP, Attention  # noqa: E402


def _shard(linear: nn.Linear, dim: int, rank: int, world: int) -> None:
    """Keep this rank's slice of the weight: output features (dim 0) or input features (dim 1)."""
    weight = linear.weight.detach()
    if weight.shape[dim] % world:
        raise ValueError(f"cannot split {weight.shape[dim]} features over {world} ranks")
    linear.weight = nn.Parameter(weight.chunk(world, dim)[rank].clone(), requires_grad=linear.weight.requires_grad)
    if linear.bias is not None and dim == 0:
        linear.bias = nn.Parameter(linear.bias.detach().chunk(world)[rank].clone())
    linear.in_features, linear.out_features = linear.weight.shape[1], linear.weight.shape[0]


def _all_reduce_output(module: nn.Module, group) -> None:
    module.register_forward_hook(lambda _module, _inputs, out: funcol.all_reduce(out, "sum", group))


def apply_tensor_parallel(model: nn.Module, group=None) -> nn.Module:
    """Shard every :class:`Attention` and :class:`MLP` of ``model`` over ``group`` (default: the world)."""
    group = group or dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    for module in model.modules():
        if isinstance(module, Attention):
            if module.n_heads % world or module.n_kv_heads % world:
                raise ValueError(f"{module.name}: {module.n_heads} query and {module.n_kv_heads} K/V heads "
                                 f"do not split over {world} ranks")
            module.n_heads //= world
            module.n_kv_heads //= world
            for name in ("q_proj", "k_proj", "v_proj"):
                if hasattr(module, name):
                    _shard(getattr(module, name), 0, rank, world)
            _shard(module.o_proj, 1, rank, world)
            _all_reduce_output(module.o_proj, group)
        elif isinstance(module, MLP):
            _shard(module.gate, 0, rank, world)
            _shard(module.up, 0, rank, world)
            _shard(module.down, 1, rank, world)
            _all_reduce_output(module.down, group)
    return model


def main() -> None:
    """``torchrun --nproc-per-node 2 examples/tp.py``: the tiny Gemma-3n-like model, sharded, through
    the Runner on every rank; rank 0 prints the report and whether the tokens match one process."""
    import fx_fastprefill
    from examples.gemma3n import tiny
    dist.init_process_group("gloo")
    full = tiny()
    model = apply_tensor_parallel(copy.deepcopy(full))
    prompts = [[(7 * i + j) % 500 + 1 for j in range(12 + 3 * i)] for i in range(3)]
    backend = fx_fastprefill.backend(compiler="eager")
    tokens = fx_fastprefill.Runner(model, backend=backend, max_num_tokens=64).generate(prompts, max_new_tokens=6)
    reference = fx_fastprefill.Runner(full, backend="eager", max_num_tokens=64).generate(prompts, max_new_tokens=6)
    if dist.get_rank() == 0:
        print(backend.reports[-1].summary())
        print("tokens equal to one process:", tokens == reference)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
