"""The private torch names the package uses are all in fx_fastprefill/torch_seams.py, and each of
them resolves on the installed torch: a release that moves one fails here, by name, not somewhere
deep in a compile."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import torch

from fx_fastprefill import torch_seams

PACKAGE = Path(__file__).resolve().parents[1] / "fx_fastprefill"
SEAMS = PACKAGE / "torch_seams.py"


def _private_torch_names(tree: ast.AST) -> set[str]:
    """``torch._x...`` attribute paths and imports from torch's private modules (or of private names)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            private_module = any(part.startswith("_") for part in node.module.split(".")[1:])
            found |= {f"{node.module}.{a.name}" for a in node.names if private_module or a.name.startswith("_")}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names
                      if a.name.startswith("torch.") and any(p.startswith("_") for p in a.name.split(".")[1:])}
        elif isinstance(node, ast.Attribute):
            parts, value = [], node
            while isinstance(value, ast.Attribute):
                parts.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id == "torch" and any(
                    p.startswith("_") and not p.startswith("__") for p in parts):
                found.add(".".join(["torch", *reversed(parts)]))
    return found


def test_no_private_torch_name_outside_the_seams():
    outside = {str(path.relative_to(PACKAGE)): names for path in sorted(PACKAGE.rglob("*.py")) if path != SEAMS
               for names in [_private_torch_names(ast.parse(path.read_text()))] if names}
    assert not outside, f"private torch names outside torch_seams.py (move them behind a seam): {outside}"


def _imports_of_seams() -> list[tuple[str, str]]:
    return sorted({(node.module, alias.name) for node in ast.walk(ast.parse(SEAMS.read_text()))
                   if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch")
                   for alias in node.names})


@pytest.mark.parametrize("module,name", _imports_of_seams())
def test_every_name_a_seam_imports_exists_in_this_torch(module, name):
    if module.startswith("torch.distributed") and not torch.distributed.is_available():
        pytest.skip("torch.distributed is not built")
    assert hasattr(importlib.import_module(module), name), f"torch {torch.__version__} has no {module}.{name}"


def test_the_settings_the_package_patches_exist():
    """Each config key the package sets or reads, by its seam (a renamed key would be a silent no-op
    for some of them, or a KeyError deep in a compile)."""
    for config, keys in ((torch_seams.functorch_config, ("enable_autograd_cache", "bundled_autograd_cache")),
                         (torch_seams.inductor_config, ("post_grad_custom_post_pass", "triton.cudagraphs")),
                         (torch_seams.dynamo_config, ("specialize_float",)),
                         (torch_seams.fx_config, ("use_duck_shape",))):
        current = config.get_config_copy()
        for key in keys:
            assert key in current, f"torch {torch.__version__}: {config.__name__}.{key} is gone"
            with config.patch({key: current[key]}):  # patch itself refuses a key it does not know
                pass
    assert torch_seams.mode_options("reduce-overhead", None).get("triton.cudagraphs") is True


def test_the_dynamo_seams_answer():
    assert torch_seams.aot_compile_available()
    assert isinstance(torch_seams.graphs_compiled(), int)
    unsupported = torch_seams.unsupported_serialization_guard_types()
    assert unsupported and all(isinstance(t, str) for t in unsupported)
    assert len(torch_seams.inductor_decompositions()) > 100
    x = torch.ones(3, 4)
    torch_seams.maybe_mark_dynamic(x, 0)
    assert 0 in getattr(x, "_dynamo_weak_dynamic_indices", set())


def test_a_backend_result_is_wrapped_for_saving_once():
    """What AOTAutograd returns (it has ``serialize``) is wrapped; a wrapped one, whose attribute
    reads reach what it wraps, and a plain function are returned as they are."""
    class AOTCompiled:
        def serialize(self) -> bytes:
            return b""

        def __call__(self, *args):
            return args

    wrapped = torch_seams.serializable_backend_result(AOTCompiled())
    assert wrapped.__class__.__name__ == "BundledAOTAutogradSerializableCallable" and callable(wrapped.serialize)
    assert torch_seams.serializable_backend_result(wrapped) is wrapped
    plain = lambda *args: args  # noqa: E731
    assert torch_seams.serializable_backend_result(plain) is plain


def test_the_patching_seams_put_torch_back():
    """Entered and left, the function it patches is the original again."""
    from torch._dynamo import guards
    pickle_state = guards.pickle_guards_state
    import contextlib
    with torch_seams.guards_pickled_within(lambda state: contextlib.nullcontext()):
        assert guards.pickle_guards_state is not pickle_state
    assert guards.pickle_guards_state is pickle_state


def test_output_strides_stay_out_of_the_enclosing_compile():
    """A region compiled or reloaded inside AOTAutograd's compile reports no output strides to it
    (AOT restrides its own graph's outputs by what is reported), and the context is put back."""
    from torch._guards import TracingContext, tracing
    with torch_seams.output_strides_unreported():  # outside any compile: nothing to keep apart
        pass
    context = TracingContext(None)
    with tracing(context):
        context.output_strides = reported = []
        with torch_seams.output_strides_unreported():
            assert context.output_strides is None
        assert context.output_strides is reported


def test_the_fake_and_dispatch_seams():
    with torch_seams.fake_tensor_mode() as mode:
        fake = torch.empty(2, 3)
        with torch_seams.no_dispatch_modes():
            real = torch.empty(2, 3)
    assert fake.fake_mode is mode and not hasattr(real, "fake_mode")
    from fx_fastprefill.ops.schema import OpOverload
    # The op-overload class read off a public op is the one custom ops are made of, and not the packet's.
    assert isinstance(torch.ops.fx_fastprefill.attention.default, OpOverload)
    assert not isinstance(torch.ops.aten.mm, OpOverload) and isinstance(torch.ops.aten.add.Tensor, OpOverload)
    assert torch_seams.static_input_indices() == []  # outside a compile: none
    assert hasattr(torch.ops.aten, "_flash_attention_forward")


def test_the_logging_seam_registers_the_package_log():
    torch_seams.register_torch_log("fx_fastprefill", enable_now=False)
    from torch._logging import _internal
    assert "fx_fastprefill" in _internal.log_registry.log_alias_to_log_qnames
