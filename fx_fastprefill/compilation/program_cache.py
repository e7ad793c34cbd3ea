"""The backend's compiled program in torch's AOTAutograd cache: a warm restart skips AOT's
retrace, the passes and Inductor.

AOTAutograd caches what a compiler returns when the compiler is a
``SerializableAOTDispatchCompiler``; with ``torch._functorch.config.bundled_autograd_cache`` the
returned ``OutputCode`` itself is pickled into the cache entry (how Inductor stores its regional
compile). The backend returns :class:`ProgramCode`: the :class:`CompiledProgram` (split graph,
compiled regions and pieces as Inductor stores them, the gate's and the pieces' specs as plain
data), the report, and the plan the ranks of a tensor-parallel graph compare. On a hit, AOT calls
:meth:`ProgramCode.post_compile`, which unpickles it and hands it to the backend that is loading
(:data:`LOADER`): the report appears in its ``reports``, fallbacks are counted on it.

AOTAutograd's key covers the Dynamo graph, its inputs and torch's and Inductor's configs, not the
compiler: :func:`cache_key_tag` adds this package's version and sources, the backend's options and
its pass list (each pass by name and source, or its ``uuid()``), so a changed source or option is a
new key (a miss, never a stale program). A pass whose behaviour its source does not pin (a closure,
a partial, an object without ``uuid()``) makes the backend uncached.

Private torch APIs, written against torch 2.11 and 2.13; where one is missing the backend compiles
uncached (``fallbacks.NO_PROGRAM_CACHE``, logged).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import importlib.metadata
import inspect
import logging
import pickle
import reprlib
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from .. import fallbacks
from ..fallbacks import FallbackCounter
from ..report.report import FastPrefillReport
from ..torch_seams import CustomGraphPass, OutputCode, SerializableAOTDispatchCompiler, functorch_config, \
    inductor_config, no_dispatch_modes
from . import program_env
from .damaged_files import record_damage
from .program_env import ProgramEnv
from .regions import CompiledProgram

log = logging.getLogger("fx_fastprefill")


# Set by the backend while AOTAutograd runs: called with each ProgramCode loaded from the cache.
LOADER: contextvars.ContextVar[Callable[["ProgramCode"], None] | None] = contextvars.ContextVar(
    "fx_fastprefill_program_loader", default=None)
CHECKSUM_BYTES = 32  # sha256


class DamagedArtifact(ValueError):
    """Saved bytes that do not match the checksum saved with them."""


def sealed(payload: bytes) -> bytes:
    """``payload`` behind its sha256: what is saved, so that a damaged copy is detected on load."""
    return hashlib.sha256(payload).digest() + payload


def unsealed(data: bytes, what: str) -> bytes:
    """The payload of :func:`sealed` bytes; DamagedArtifact where the checksum does not match."""
    digest, payload = data[:CHECKSUM_BYTES], data[CHECKSUM_BYTES:]
    if len(data) < CHECKSUM_BYTES or hashlib.sha256(payload).digest() != digest:
        raise DamagedArtifact(f"{what} is damaged: its sha256 does not match the one saved with it")
    return payload


class ProgramCode(OutputCode):
    """What the backend returns to AOTAutograd: a program that runs, and pickles into its cache."""

    def __init__(self, program: CompiledProgram, report: FastPrefillReport, groups: list[str], fingerprint: str,
                 record_fallback: Callable[[str], None] | None = None,
                 graph_keys: program_env.GraphKeys = program_env.GraphKeys.NONE):
        self._boxed_call = True  # on the instance: AOT's wrappers copy the instance's __dict__, not the class's
        self.program: CompiledProgram | None = program
        self.report: FastPrefillReport | None = report
        self.groups, self.fingerprint = groups, fingerprint  # what the ranks compare (compilation/spmd.py)
        # Inductor keys a kernel's autotuning result with the tag in effect when the kernel is
        # loaded: the program reloads its kernels under the tag they were compiled (and tuned) under
        # (the user's, :func:`compiling_regions`), whoever loads it (the backend's cache hit, under
        # the program's tag, or a precompiled function).
        self.cache_key_tag = torch.compiler.config.cache_key_tag
        self._pickled: bytes | None = None
        self.record_fallback = record_fallback  # the compiling backend's: counts a program that is not saved
        # What the program reads at run time (program_env.py); a loaded program gets its loader's.
        self.env: ProgramEnv | None = ProgramEnv(record_fallback or FallbackCounter().record)
        self.graph_keys = graph_keys  # how its recorded graphs are keyed, declared to the caller (kept when saved)

    def __call__(self, inputs: list) -> list:
        with program_env.running(self.env, self.graph_keys):
            return self.program(inputs)

    def prepare_for_serialization(self) -> None:
        # The report's graph and node names are the compile's FX objects (its printed picture): not kept.
        report = dataclasses.replace(self.report, graph=None, placeholder_names={})
        with _real_tensors():
            try:
                self._pickled = sealed(pickle.dumps((self.program, report)))
            except Exception as e:  # AOTAutograd logs it and saves nothing: say which part does not pickle
                where = unpicklable_part({"program": self.program, "report": report})
                if self.record_fallback is not None:  # None once counted: once per program, however often saved
                    self.record_fallback(fallbacks.PROGRAM_NOT_SAVED)
                    self.record_fallback = None
                raise pickle.PicklingError(f"the compiled program does not pickle, at {where}: "
                                           f"{type(e).__name__}: {e}") from e
        self.program = self.report = self.record_fallback = self.env = None  # the backend's counter is not saved

    def post_compile(self, example_inputs: Sequence[Any], constants: Any, graph_kwargs: Any) -> None:
        """A cache hit: the program unpickled (its compiled graphs reloaded) and handed to the loader."""
        if self.program is None:
            try:
                payload = unsealed(self._pickled, "the compiled program")
            except DamagedArtifact:  # AOTAutograd then compiles the graph again (a bypass of its cache)
                log.warning("a compiled program in the AOTAutograd cache is damaged (checksum mismatch): "
                            "compiled again")
                record_damage(fallbacks.PROGRAM_DAMAGED)
                raise
            with torch.compiler.config.patch(cache_key_tag=self.cache_key_tag), _real_tensors():
                self.program, self.report = pickle.loads(payload)
            self._pickled = None
        loader = LOADER.get()
        if loader is not None:
            loader(self)  # which gives it the loading backend's env
        else:  # loaded outside the backend (torch's own precompile): its fallbacks counted here only
            self.env = ProgramEnv(FallbackCounter().record)

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        """Each compiled graph inside carries its own kernels."""


def _real_tensors() -> contextlib.AbstractContextManager:
    """No dispatch mode while the program is pickled or unpickled: AOTAutograd saves it inside its
    FakeTensorMode, where a CUDA tensor constant (Gemma 3n's activation sparsity) cannot be copied
    to the CPU to pickle (seen on the GPU), and a constant unpickled under such a mode comes back a
    FakeTensor."""
    return no_dispatch_modes()


def unpicklable_part(obj: Any, path: str = "", depth: int = 8) -> str:
    """The deepest attribute path under ``obj`` that does not pickle (as pickling sees it: through
    ``__getstate__``): a failed save names what to fix, not only the object type pickle hit."""
    try:
        pickle.dumps(obj)
        return ""
    except Exception:  # noqa: BLE001 - any failure: look inside
        pass
    here = f"{path or '(the object)'} ({type(obj).__qualname__}: {reprlib.repr(obj)})"
    if depth == 0:
        return here
    if isinstance(obj, dict):
        children = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple)):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    else:
        try:
            state = obj.__getstate__() if hasattr(obj, "__getstate__") else getattr(obj, "__dict__", None)
        except Exception as e:  # noqa: BLE001 - its own __getstate__ refuses: this is the part
            return f"{here}, whose __getstate__ raised {type(e).__name__}: {e}"
        state = state[1] if isinstance(state, tuple) and len(state) == 2 and state[0] is None else state
        children = [(f"{path}.{k}", v) for k, v in state.items()] if isinstance(state, dict) else []
    for child_path, child in children:
        found = unpicklable_part(child, child_path, depth - 1)
        if found:
            return found
    return here


def can_save() -> bool:
    """Whether this torch has AOTAutograd's cacheable compiler (:func:`serializable`)."""
    return SerializableAOTDispatchCompiler is not None


def serializable(compiler: Callable[..., ProgramCode]) -> Callable[..., ProgramCode]:
    """``compiler`` as AOTAutograd's cacheable compiler (where :func:`can_save`)."""
    return SerializableAOTDispatchCompiler(ProgramCode, compiler)


@functools.lru_cache(maxsize=None)
def package_digest() -> str:
    """A hash of this package's version and every source file it runs (``passes/`` included)."""
    import fx_fastprefill
    from fx_fastprefill import passes
    try:
        version = importlib.metadata.version("fx_fastprefill")
    except importlib.metadata.PackageNotFoundError:
        version = "not installed"
    return version + "-" + digest_sources((Path(fx_fastprefill.__file__).parent, Path(passes.__file__).parent))


def digest_sources(roots: Sequence[Path]) -> str:
    """A hash of the ``.py`` files under ``roots``: their paths and contents."""
    digest = hashlib.sha256()
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _pass_identity(pass_: Callable[..., Any]) -> str | None:
    """A pass by qualified name and source, or by its own ``uuid()`` (Inductor's custom-pass
    convention); None where neither says all it does: no readable source, or state the source does
    not show (a closure, a partial, a callable object without ``uuid``)."""
    name = f"{getattr(pass_, '__module__', '?')}.{getattr(pass_, '__qualname__', type(pass_).__qualname__)}"
    if callable(getattr(pass_, "uuid", None)):
        return f"{name}:uuid:{pass_.uuid()}"
    if not inspect.isfunction(pass_) or pass_.__closure__ or pass_.__defaults__ or pass_.__kwdefaults__:
        return None
    try:
        source = inspect.getsource(pass_)
    except (OSError, TypeError):
        return None
    return name + ":" + hashlib.sha256(source.encode()).hexdigest()


def cache_key_tag(options: dict[str, Any], passes: Sequence[Callable[..., Any]]) -> str | None:
    """The tag that keys the backend's programs apart from any other compiler's and from each
    other's: the package, the options, the passes. None where a pass cannot be keyed."""
    identities = [_pass_identity(p) for p in passes]
    if None in identities:
        return None
    text = "\n".join([package_digest(), repr(sorted(options.items())), *identities])
    return "fx_fastprefill-" + hashlib.sha256(text.encode()).hexdigest()[:32]


class PackageSourcesKey(CustomGraphPass):
    """A post-grad pass that changes nothing: its ``uuid()`` puts this package's sources (and the
    uuid of a custom pass of the user's, which it runs) into Inductor's FX graph key of a region."""

    def __init__(self, users_pass: CustomGraphPass | None):
        self.users_pass = users_pass

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.users_pass is not None:
            self.users_pass(graph)

    def uuid(self) -> Any:
        return package_digest(), self.users_pass.uuid() if self.users_pass is not None else None


@contextlib.contextmanager
def compiling_regions(users_tag: str) -> Iterator[None]:
    """While the backend compiles a program's regions and pieces, which go through Inductor's FX
    graph cache (bundling turns it off; so a new program reuses the graphs an earlier one
    compiled):

    - the cache tag is the user's, not the program's: Inductor keys a kernel's autotuning result
      with the tag, and its compile workers, which do not see a tag set in this process, key theirs
      without it; a kernel compiled here must be keyed as theirs are for a warm start to find its
      tuning;
    - the package's sources key the regions instead (:class:`PackageSourcesKey`): a region calls
      the package's ops, whose fake implementations Inductor's code was generated against. A user's
      post-grad pass that is not a ``CustomGraphPass`` is left alone: Inductor does not cache then.
    """
    users_pass = inductor_config.post_grad_custom_post_pass
    keyed = {"post_grad_custom_post_pass": PackageSourcesKey(users_pass)} \
        if users_pass is None or isinstance(users_pass, CustomGraphPass) else {}
    with functorch_config.patch(bundled_autograd_cache=False), \
            torch.compiler.config.patch(cache_key_tag=users_tag), inductor_config.patch(**keyed):
        yield


@contextlib.contextmanager
def loading(loader: Callable[[ProgramCode], None] | None) -> Iterator[None]:
    """Within: each program loaded (from AOTAutograd's cache, or with a precompiled function) is
    handed to ``loader``."""
    token = LOADER.set(loader)
    try:
        yield
    finally:
        LOADER.reset(token)


@contextlib.contextmanager
def caching(tag: str, loader: Callable[[ProgramCode], None]) -> Iterator[None]:
    """Within: AOTAutograd bundles and serves programs keyed with ``tag`` (after any tag of the
    user's own), and hands each one it loads to ``loader``."""
    user_tag = torch.compiler.config.cache_key_tag
    with loading(loader), functorch_config.patch(bundled_autograd_cache=True), \
            torch.compiler.config.patch(cache_key_tag=f"{user_tag}|{tag}" if user_tag else tag):
        yield
