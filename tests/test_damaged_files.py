"""Damaged files of Inductor's cache (compilation/damaged_files.py): a load that fails on a cached
``.py`` or ``.so`` deletes it and runs again; nothing outside the cache folder is touched; a file
that fails again is raised, not retried forever. (The end-to-end case, every output-code file of a
cached program truncated: tests/test_program_cache.py.)"""

from __future__ import annotations

import ctypes
import ctypes.util
import shutil
from pathlib import Path

import pytest

from fx_fastprefill import fallbacks
from fx_fastprefill.compilation import damaged_files


def _shared_library() -> Path:
    found = ctypes.util.find_library("m")
    if found is None:
        pytest.skip("no libm to stand in for a compiled kernel")
    for folder in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib"):
        if (Path(folder) / found).is_file():
            return Path(folder) / found
    pytest.skip(f"{found} not found on disk")


def _kernel_loader(path: Path, good: Path):
    """Inductor's way with a kernel: build it where it is missing, then load it."""
    def load() -> ctypes.CDLL:
        if not path.exists():
            shutil.copy(good, path)
        return ctypes.CDLL(str(path))
    return load


def test_a_truncated_kernel_library_is_deleted_built_again_and_counted(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    good = _shared_library()
    kernel = tmp_path / "ab" / "cabc.main.so"
    kernel.parent.mkdir()
    kernel.write_bytes(good.read_bytes()[:16])  # a build cut short (inside its ELF header)
    counted = fallbacks.FallbackCounter()
    with damaged_files.counted_by(counted.record):
        library = damaged_files.dropping_damaged_files(_kernel_loader(kernel, good), "loading a kernel")
    assert isinstance(library, ctypes.CDLL) and kernel.read_bytes() == good.read_bytes()
    assert counted == {fallbacks.COMPILED_FILE_DAMAGED: 1}


def test_a_damaged_file_outside_the_cache_folder_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    kernel = tmp_path / "users_own.so"
    kernel.write_bytes(b"not a library")
    with pytest.raises(OSError):
        damaged_files.dropping_damaged_files(lambda: ctypes.CDLL(str(kernel)), "loading a kernel")
    assert kernel.read_bytes() == b"not a library"


def test_a_file_that_fails_again_after_it_was_made_again_is_raised(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    code = tmp_path / "cx.py"
    made = []

    def load() -> None:
        if not code.exists():
            code.write_text("def call(:\n")  # the code itself is bad: no file repairs that
            made.append(code)
        compile(code.read_text(), str(code), "exec")
    code.write_text("def call(:\n")
    counted = fallbacks.FallbackCounter()
    with damaged_files.counted_by(counted.record), pytest.raises(SyntaxError):
        damaged_files.dropping_damaged_files(load, "loading a graph")
    assert len(made) == 1 and counted == {fallbacks.COMPILED_FILE_DAMAGED: 1}


def test_only_cached_code_and_libraries_are_named():
    cache = damaged_files.inductor_cache_dir()
    assert damaged_files.damaged_file(ValueError("no file here")) is None
    assert damaged_files.damaged_file(RuntimeError(f"Failed to import {cache}/zz/not-there.py")) is None
