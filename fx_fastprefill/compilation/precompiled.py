"""A compiled path saved whole and loaded by the next process: a warm start skips Dynamo too.

``torch.compile(fn, fullgraph=True).aot_compile(example)`` traces and compiles once and returns a
function with Dynamo's guards; it serializes to bytes (its bytecode, guards and compiled program:
for this package's backend the :class:`~.program_cache.ProgramCode`), and
``torch.compiler.load_compiled_function`` reads it back without tracing. :class:`PrecompiledFunction`
keeps such functions for one path of a model (the prefill of ``compile_for_generate``, say) in a
folder: a call runs the first whose guards pass; when none passes, one is compiled and saved
(counted as a guard miss, logged with the failed guard).

Guards that cannot be saved are dropped when compiling (:func:`serializable_guards`): identities of
objects (which function an activation calls, which module object is which) and globals. What they
pinned is in the file's key instead (:func:`model_key`): the model's class, config and parameter
shapes, the source files of its modules' classes, the package's sources, the compile's options,
torch and Python. The code the function traced is pinned by content: the file keeps a digest of
every source file Dynamo inlined for it, and a file whose traced code has changed since is not
loaded (:func:`changed_sources`). The kept guards (tensor shapes, dtypes and devices, config values
the trace read, grad mode) are checked on every call. Parameters are inputs read from the model at
each call, so a loaded function runs the weights the model has now.

Every read and write of the folder fails soft: a folder that cannot be written (read-only, a file,
under a file) leaves the path compiling through ``torch.compile`` (counted, logged), never raising.

Private torch APIs (written against torch 2.11 and 2.13); where one is missing or a compile cannot
be saved (a graph break, an object that does not pickle), the path compiles through
``torch.compile`` as without precompiling (counted, logged). So does a model on several ranks
(tensor parallel): a loaded function would skip the ranks' agreement on one cut. A function
compiled whose own serialization fails still serves the calls it fits in this process (its compile
is not paid twice); a backend program that does not pickle fails ``aot_compile`` itself (it makes
AOTAutograd's cache strict), and that path compiles again through ``torch.compile``.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import logging
import os
import pickle
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from .. import fallbacks, torch_seams
from . import program_cache
from .damaged_files import counted_by, inductor_cache_dir
from .importable import Reference, reference_to, resolve
from .model_key import changed_sources, model_key, serializable_guards, traced_sources

log = logging.getLogger("fx_fastprefill")

FORMAT = 3  # 2: the digests of the traced sources; 3: the file behind its sha256
MAX_FUNCTIONS = 8  # per path, like Dynamo's recompile limit: past it, the path compiles as usual


def available() -> bool:
    """This torch can compile ahead of time, save and load."""
    return hasattr(torch.compiler, "load_compiled_function") and torch_seams.aot_compile_available()


def _ranks() -> int:
    """The default process group's size; 1 without torch.distributed."""
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def default_folder() -> Path:
    """Inductor's cache folder (``TORCHINDUCTOR_CACHE_DIR``, else its default,
    ``<temp>/torchinductor_<user>``) / fx_fastprefill / precompiled."""
    return inductor_cache_dir() / "fx_fastprefill" / "precompiled"


def folder_for(precompile: bool | str | os.PathLike) -> Path | None:
    """The folder a ``precompile=`` argument names: :func:`default_folder` for True, None for False.
    Raises TypeError for anything else."""
    if not isinstance(precompile, (bool, str, os.PathLike)):
        raise TypeError(f"precompile must be a bool or a folder, got {precompile!r}")
    if precompile is True:
        return default_folder()
    return Path(precompile) if precompile else None


def _traced_function(method: Callable[..., Any]) -> Callable[..., Any]:
    """The function Dynamo traces for ``method`` (a bound method: its function)."""
    return getattr(method, "__func__", method)


def _closure_data(method: Callable[..., Any]) -> dict[str, object]:
    """The traced function's closure (a decorator's wrapped function): given to the saved function
    by reference, not pickled, and looked up again from the model's class on load."""
    fn = _traced_function(method)
    return {f"closure.{name}": cell.cell_contents
            for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ())}


def _serializable(backend: Any) -> Any:
    """``backend``, its result wrapped for saving where it is an AOTAutograd-compiled function:
    torch 2.13's aot_compile does that itself, 2.11's only for Inductor."""
    if isinstance(backend, str):
        return backend

    def compile_serializable(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        return torch_seams.serializable_backend_result(backend(gm, example_inputs))
    return compile_serializable


def _global_references(compiled: Any, f_globals: dict[str, Any]) -> dict[str, Reference]:
    """Globals the saved bytecode reads that torch does not save itself (modules and functions
    Dynamo installed under generated names): each by how to import it again. Raises ValueError for
    one that cannot be imported by name."""
    env = compiled._artifacts.runtime_env
    known = set(env.import_sources) | set(env.used_globals) | {compiled._artifacts.backend_id}
    references = {}
    for name in sorted(env.external_refs - known):
        if hasattr(builtins, name) or name not in f_globals:
            continue
        references[name] = reference_to(f_globals[name])
        if references[name] is None:
            raise ValueError(f"the compiled code reads the global {name!r} ({type(f_globals[name]).__name__}), "
                             f"which cannot be imported by name")
    return references


@contextlib.contextmanager
def without(model: torch.nn.Module, names: tuple[str, ...]) -> Iterator[None]:
    """Within: the attributes ``names`` taken off the model's instance (put back after)."""
    saved = {name: model.__dict__.pop(name) for name in names if name in model.__dict__}
    try:
        yield
    finally:
        model.__dict__.update(saved)


def _local_key_order() -> contextlib.AbstractContextManager:
    """Dynamo saves, with a function's guards, every dict whose key order it guards, and looks each
    up again when the function is loaded. A global one has the order its process filled it in
    (transformers' registry of output recorders gains a key per model class built): a process that
    built other classes first saved an index past the end of the next one's (IndexError on load).
    Only the model's own (local) dicts are saved: guards on globals are not saved anyway
    (:func:`serializable_guards`), what they pinned is in the key."""
    @contextlib.contextmanager
    def local_only(state: Any) -> Iterator[None]:
        order = state.output_graph.guard_on_key_order
        state.output_graph.guard_on_key_order = {source for source in order if source.guard_source.is_local()}
        try:
            yield
        finally:
            state.output_graph.guard_on_key_order = order
    return torch_seams.guards_pickled_within(local_only)


@contextlib.contextmanager
def _builtins_resolve(f_globals: dict[str, Any]) -> Iterator[None]:
    """torch 2.11's aot_compile checks that the traced function's globals (``f_globals``) hold every
    name its bytecode reads, missing that builtins (``type``) resolve through ``__builtins__``, and
    refuses the function it just made; 2.13 saves the builtins it reads. On 2.11 and 2.12 the
    builtins the module does not define are put in its globals while compiling (the very objects a
    lookup finds anyway) and taken out after."""
    if torch.__version__ >= "2.13":
        yield
        return
    added = {name: value for name, value in vars(builtins).items()
             if name not in f_globals and not name.startswith("__")}
    f_globals.update(added)
    try:
        yield
    finally:
        for name, value in added.items():
            if f_globals.get(name) is value:
                del f_globals[name]


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` to ``path`` by a rename: a reader sees the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, prefix=path.name + ".") as f:
        f.write(data)
        temp = f.name
    os.replace(temp, path)


def _oldest_first(paths: Iterator[Path]) -> list[Path]:
    """``paths`` by modification time; one that vanished meanwhile (another process) is left out."""
    dated = []
    for path in paths:
        try:
            dated.append((path.stat().st_mtime, path))
        except OSError:
            continue
    return [path for _, path in sorted(dated)]


class PrecompiledFunction:
    """One compiled path of a model, through functions saved in ``folder``: each call runs the first
    loaded or compiled function whose guards pass, else compiles (and saves) a new one.

    ``method``: the model's bound forward. ``compile_options``: ``torch.compile``'s (``backend``,
    ``dynamic``, Inductor ``options``). ``fallback``: the same path under plain ``torch.compile``,
    run where precompiling is not possible. ``prepare(args, kwargs)``: run before the guard checks
    of a call (clears what the guards must not see). ``compile_context(args, kwargs,
    functions_so_far)``: entered around a compile (marks inputs dynamic). ``loader``: given each
    program of this package's backend loaded with a function (the backend's reports and counters
    adopt it). ``keyable``: False where the compile's options cannot be keyed (a backend without a
    cache tag): the path falls back.
    ``hidden``: attributes of the model's instance set by the caller (wrappers of its ``forward``)
    taken off it while compiling: Dynamo saves the model's instance state with the guards, and
    these hold the compiler's own objects."""

    def __init__(self, method: Callable[..., Any], *, name: str, folder: Path, options_key: str,
                 compile_options: dict[str, Any], fallback: Callable[..., Any],
                 record_fallback: Callable[[str], None], prepare: Callable[[tuple, dict], None] | None = None,
                 compile_context: Callable[[tuple, dict, int], contextlib.AbstractContextManager] | None = None,
                 loader: Callable[[Any], None] | None = None, keyable: bool = True, hidden: tuple[str, ...] = ()):
        self.model = method.__self__
        self.method = method
        self.name = name
        self.folder = Path(folder)
        self.compile_options = compile_options
        self.fallback = fallback
        self.record_fallback = record_fallback
        self.prepare = prepare
        self.compile_context = compile_context
        self.loader = loader
        self.hidden = hidden
        self.functions: list[Any] = []  # loaded or compiled, in the order their guards are checked
        self.unloaded: list[Path] = []  # saved functions not loaded yet, oldest first
        self.loaded = self.compiled = 0
        self.failed: str | None = None  # why this path runs ``fallback`` from now on
        self.key = model_key(self.model, options_key, hidden)
        if not available():
            self._give_up(fallbacks.PRECOMPILE_UNAVAILABLE, f"torch {torch.__version__} has no aot_compile")
        elif not keyable:
            self._give_up(fallbacks.PRECOMPILE_UNAVAILABLE, "the compile's backend cannot be keyed")
        elif (ranks := _ranks()) > 1:
            # A loaded function skips the backend, so the ranks would not compare their cuts
            # (compilation/spmd.py), and a rank could load a file another rank saved, with that
            # rank's shard offsets in its graph.
            self._give_up(fallbacks.PRECOMPILE_UNAVAILABLE, f"the model runs on {ranks} ranks (tensor parallel)")
        else:
            self.unloaded = _oldest_first(self.folder.glob(f"{self.name}-{self.key}-*.bin"))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.failed and not self.functions:
            return self.fallback(*args, **kwargs)
        if self.prepare is not None:
            self.prepare(args, kwargs)
        for function in self._candidates():
            if function.guard_check(self.model, *args, **kwargs):
                return function(self.model, *args, **kwargs)
        if self.failed:  # the functions in hand serve the calls they fit; no new one is compiled here
            return self.fallback(*args, **kwargs)
        if self.functions:
            self.record_fallback(fallbacks.PRECOMPILED_GUARD_MISS)
            log.info("precompiled %s: no saved function's guards pass (%s); compiling another",
                     self.name, self._miss_reason(args, kwargs))
        if len(self.functions) >= MAX_FUNCTIONS:
            self._give_up(fallbacks.PRECOMPILE_FAILED, f"more than {MAX_FUNCTIONS} functions")
            return self.fallback(*args, **kwargs)
        function = self._compile(args, kwargs)
        if function is None:
            return self.fallback(*args, **kwargs)
        return function(self.model, *args, **kwargs)

    def state(self) -> str:
        """What this path did, in a line: loaded and compiled, or why it compiles through torch.compile."""
        if not self.failed:
            return f"{self.loaded} loaded, {self.compiled} compiled and saved"
        in_hand = f"; {len(self.functions)} function(s) in hand serve the calls they fit" if self.functions else ""
        return f"compiles through torch.compile ({self.failed}){in_hand}"

    def _new_path(self) -> Path:
        return self.folder / f"{self.name}-{self.key}-{uuid.uuid4().hex[:12]}.bin"

    def _candidates(self) -> Iterator[Any]:
        """The functions in hand, then the saved ones, each loaded only when those before it do not
        fit the call: a warm start loads what its calls need, not every file (the first output comes
        sooner, and a path that is never called is never loaded)."""
        yield from list(self.functions)
        while self.unloaded:
            function = self._load(self.unloaded.pop(0))
            if function is not None:
                yield function

    def _load(self, path: Path) -> Any:
        stage = "reading the file"
        try:
            try:
                saved = pickle.loads(program_cache.unsealed(path.read_bytes(), f"the file {path.name}"))
            except program_cache.DamagedArtifact:
                path.unlink(missing_ok=True)  # dropped: the path compiles and saves a sound one
                raise
            if saved.get("format") != FORMAT:
                raise ValueError(f"format {saved.get('format')}, this package reads {FORMAT}")
            changed = changed_sources(saved["sources"])
            if changed:
                self.record_fallback(fallbacks.PRECOMPILED_STALE)
                log.warning("precompiled %s: %s not loaded: the code it traced has changed since it was saved (%s)",
                            self.name, path, ", ".join(changed))
                return None
            stage = "importing the globals its code reads"
            # torch 2.13 saves the builtins the bytecode reads, 2.11 does not
            f_globals = {**vars(builtins), **_traced_function(self.method).__globals__}
            f_globals.update({name: resolve(ref) for name, ref in saved["globals"].items()})
            stage = "rebuilding its guards and compiled program against this process's model and modules"
            with program_cache.loading(self.loader), counted_by(self.record_fallback):
                function = torch.compiler.load_compiled_function(
                    io.BytesIO(saved["function"]), f_globals=f_globals, external_data=_closure_data(self.method))
        except Exception as e:  # noqa: BLE001 - a file that does not load is skipped: counted, logged
            self.record_fallback(fallbacks.PRECOMPILED_LOAD_FAILED)
            log.warning("precompiled %s: %s not loaded: %s failed (%s: %s)", self.name, path, stage,
                        type(e).__name__, e)
            log.debug("loading %s failed", path, exc_info=True)
            return None
        function.disable_guard_check()  # checked by __call__ before each call
        self.functions.append(function)
        self.loaded += 1
        log.info("precompiled %s: loaded %s", self.name, path)
        return function

    def _compile(self, args: tuple, kwargs: dict) -> Any:
        """aot_compile for these inputs and save; None (and the path falls back for good) on failure."""
        context = self.compile_context(args, kwargs, len(self.functions)) if self.compile_context \
            else contextlib.nullcontext()
        guard_filter = serializable_guards(_traced_function(self.method).__code__.co_freevars)
        options = {**self.compile_options, "backend": _serializable(self.compile_options["backend"]),
                   "options": {**self.compile_options.get("options", {}), "guard_filter_fn": guard_filter}}
        try:
            # Float scalars specialized up front: aot_compile cannot restart the trace, as Dynamo does
            # when it finds a float it cannot turn into a tensor under dynamic=True.
            # torch 2.11 puts aot_compile on a compiled function only with enable_aot_compile on.
            switches = {"enable_aot_compile": True} if hasattr(torch_seams.dynamo_config, "enable_aot_compile") \
                else {}
            with context, torch_seams.dynamo_config.patch(specialize_float=True, **switches), \
                    without(self.model, self.hidden), _builtins_resolve(_traced_function(self.method).__globals__), \
                    _local_key_order():
                function = torch.compile(self.method, fullgraph=True, **options).aot_compile((args, kwargs))
        except Exception as e:  # noqa: BLE001 - the path compiles as without precompiling: counted, logged
            log.debug("precompiling %s failed", self.name, exc_info=True)
            self._give_up(fallbacks.PRECOMPILE_FAILED, f"{type(e).__name__}: {e}")
            return None
        function.disable_guard_check()
        self.functions.append(function)
        self.compiled += 1
        try:
            f_globals = _traced_function(self.method).__globals__
            # the function's own serializer (what its save_compiled_function writes to a file)
            data = type(function).serialize(function, _closure_data(self.method)).serialized_data
            saved = {"format": FORMAT, "globals": _global_references(function, f_globals),
                     "sources": traced_sources(function), "function": data}
        except Exception as e:  # noqa: BLE001 - compiled but not saved: it still serves this process
            log.debug("saving %s failed", self.name, exc_info=True)
            self._give_up(fallbacks.PRECOMPILE_FAILED, f"compiled, but not saved: {type(e).__name__}: {e}")
            return function
        try:
            write_atomically(self._new_path(), program_cache.sealed(pickle.dumps(saved)))
        except OSError as e:  # a read-only folder, a file in its place: the same
            self._give_up(fallbacks.PRECOMPILE_FOLDER_FAILED,
                          f"compiled, but not saved in {self.folder}: {type(e).__name__}: {e}")
        return function

    def _miss_reason(self, args: tuple, kwargs: dict) -> str:
        try:
            function = self.functions[0]
            return str(function._artifacts.guard_manager.check_verbose(function.prepare_f_locals(
                self.model, *args, **kwargs)).verbose_code_parts)
        except Exception:  # noqa: BLE001 - only for the log line
            return "reason unknown"

    def _give_up(self, reason: str, detail: str) -> None:
        self.failed = detail
        self.record_fallback(reason)
        log.warning("precompiled %s: %s; it compiles through torch.compile (%s)", self.name, detail, reason)
