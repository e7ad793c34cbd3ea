"""Running a test's child process (a fresh Python: what is tested is a restart) and reading the
JSON it prints last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_child(module: str, cache_dir: Path, *args: str, timeout: int = 900) -> dict:
    """``python -m module args`` with its own Inductor cache folder and a fixed hash seed (Gemma 4's
    graph follows a set's order); the last line of its stdout, as JSON."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "PYTHONHASHSEED": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
