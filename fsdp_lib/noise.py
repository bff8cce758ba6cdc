"""Import-time warnings of optional packages that a user who did not ask for them should not read: torchao (pulled
in by transformers' quantizer table whenever it is installed) logs a "Failed to load" line per CUDA kernel library
it cannot use on this machine, and registers enums with torch's pytree, which warns that this is deprecated. The
tools silence those two loggers unless the run uses torchao (--peft qlora); no torch is imported here."""

from __future__ import annotations

import logging

OPTIONAL_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


def quiet_optional_imports() -> None:
    """Errors still show; warnings of the loggers above do not."""
    for name in OPTIONAL_IMPORT_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
