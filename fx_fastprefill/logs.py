"""Switching on the ``fx_fastprefill`` logger: ``TORCH_LOGS=fx_fastprefill`` or ``FX_FASTPREFILL_LOG``.

``TORCH_LOGS="fx_fastprefill"`` (INFO) or ``"+fx_fastprefill"`` (DEBUG) works like torch's own
log names: the logger is registered with torch's logging registry. Torch parses TORCH_LOGS when
it is imported, before this package is, so registration re-reads the setting, and only when
TORCH_LOGS names us: torch's own settings are left as they are otherwise.
``FX_FASTPREFILL_LOG=info|debug`` is the fallback that needs nothing of torch's internals.
What is logged: the report at INFO when a graph is compiled, each fallback reason once at INFO,
then every occurrence at DEBUG.
"""

from __future__ import annotations

import logging
import os

LOGGER_NAME = "fx_fastprefill"
ENV_VAR = "FX_FASTPREFILL_LOG"
log = logging.getLogger(LOGGER_NAME)


def _register_with_torch_logs() -> None:
    settings = os.environ.get("TORCH_LOGS", "")
    names = {part.strip().lstrip("+-") for part in settings.split(",")}
    try:
        from .torch_seams import register_torch_log
        register_torch_log(LOGGER_NAME, enable_now=LOGGER_NAME in names)
    except (ImportError, AttributeError) as e:  # torch moved its internals: the env var still works
        if LOGGER_NAME in names:
            log.warning("TORCH_LOGS=%s is not supported by this torch (%s); use %s=info", LOGGER_NAME, e, ENV_VAR)


def _configure_from_env() -> None:
    level = os.environ.get(ENV_VAR, "").strip().upper()
    if not level:
        return
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ValueError(f"{ENV_VAR} must be one of debug, info, warning, error; got {os.environ[ENV_VAR]!r}")
    log.setLevel(level)
    if not any(getattr(h, "_fx_fastprefill", False) for h in log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[fx_fastprefill %(levelname)s] %(message)s"))
        handler._fx_fastprefill = True  # type: ignore[attr-defined]
        log.addHandler(handler)


def configure_logging() -> None:
    _register_with_torch_logs()
    _configure_from_env()
