"""Damaged files of Inductor's cache, dropped and made again instead of failing every compile.

Inductor writes a compiled graph's code (``<key>.py``) and its C++ kernels (``<key>.so``) into its
cache folder and, on a later hit, loads whatever file is there: one truncated by a full disk or a
killed process fails the load (a ``SyntaxError``, a bad ELF header) in every process after it, and
the package's compile of the cut regions with it (the graph then runs uncut) until someone deletes
the file. Inductor writes either file again when it is missing (the code from the compiled graph it
keeps, the kernel from the code's C++ source), so a load that fails naming such a file deletes it
and runs once more (counted, logged). Only ``.py`` and ``.so`` files inside Inductor's cache folder
are ever deleted, each at most once per call.
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import re
import tempfile
from contextvars import ContextVar
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from .. import fallbacks

log = logging.getLogger("fx_fastprefill")
T = TypeVar("T")

# Set by the backend while it compiles or loads a program: counts a damaged file or program.
DAMAGE_SINK: ContextVar[Callable[[str], None] | None] = ContextVar("fx_fastprefill_damage_sink", default=None)
_PATH = re.compile(r"(/[^\s'\"():,]+\.(?:py|so))\b")


def inductor_cache_dir() -> Path:
    """Inductor's cache folder: ``TORCHINDUCTOR_CACHE_DIR``, else its default ``<temp>/torchinductor_<user>``."""
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if folder:
        return Path(folder)
    try:
        user = getpass.getuser()
    except (KeyError, OSError, ModuleNotFoundError):  # no name for this uid (a bare container)
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    user = "".join("_" if c in '\\/:*?"<>|' else c for c in user)
    return Path(tempfile.gettempdir()) / f"torchinductor_{user}"


@contextlib.contextmanager
def counted_by(record_fallback: Callable[[str], None] | None) -> Iterator[None]:
    """Within: a damaged file or program found is counted by ``record_fallback``."""
    token = DAMAGE_SINK.set(record_fallback)
    try:
        yield
    finally:
        DAMAGE_SINK.reset(token)


def record_damage(reason: str) -> None:
    record = DAMAGE_SINK.get()
    if record is not None:
        record(reason)


def damaged_file(error: BaseException) -> Path | None:
    """The cached ``.py`` or ``.so`` file that ``error`` (or an error it was raised from) failed to
    load, where one is named and lies in Inductor's cache folder."""
    cache = inductor_cache_dir().resolve()
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        named = [getattr(error, "filename", None), getattr(error, "path", None), *_PATH.findall(str(error))]
        for name in named:
            if isinstance(name, str) and name.endswith((".py", ".so")):
                path = Path(name).resolve()
                if path.is_file() and path.is_relative_to(cache):
                    return path
        error = error.__cause__ or error.__context__
    return None


def dropping_damaged_files(load: Callable[[], T], what: str) -> T:
    """``load()``; where it fails on a damaged file of Inductor's cache, the file is deleted and
    ``load()`` runs again (Inductor writes the file anew), each file at most once."""
    dropped: set[Path] = set()
    while True:
        try:
            return load()
        except Exception as e:
            path = damaged_file(e)
            if path is None or path in dropped:
                raise
            dropped.add(path)
            path.unlink(missing_ok=True)
            record_damage(fallbacks.COMPILED_FILE_DAMAGED)
            log.warning("%s: the cached file %s did not load (%s: %s); deleted, made again",
                        what, path, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
