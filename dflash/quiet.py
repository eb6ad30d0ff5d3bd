"""Start quietly: drop the start-up lines an installed torchao prints on every command.

transformers imports torchao when it is installed (the ``fp8`` extra), and torchao's import
writes two kinds of lines that say nothing about the run:

- ``Failed to load .../torchao/_C_*.so: ...`` (logger ``torchao``): optional compiled kernels
  built for another Python or another card; the FP8 matmuls this project uses do not need them;
- ``<enum 'KernelPreference'> is an Enum subclass and is now natively supported by
  torch.compile ... deprecated`` (logger ``torch.utils._pytree``): torchao registering its own
  enums the old way, once per enum.

Each is dropped by a filter on the logger that emits it, matching that message only (the
pytree one only for torchao's own enums), so every other warning of torchao and torch, and
these messages from anyone else, still show. :func:`install` runs once, from ``dflash``'s
``__init__``, before anything imports transformers; it touches no handler or level.
"""

from __future__ import annotations

import logging
import re

TORCHAO_SO = re.compile(r"Failed to load \S*[/\\]_C[^/\\]*\.so\b")
PYTREE_ENUM = "is an Enum subclass and is now natively supported by torch.compile as an opaque value type"


def torchao_so_line(record: logging.LogRecord) -> bool:
    """torchao's ``Failed to load <its _C*.so>`` at import."""
    return record.levelno == logging.WARNING and TORCHAO_SO.match(str(record.msg)) is not None


def torchao_enum_line(record: logging.LogRecord) -> bool:
    """torch's deprecation of ``register_constant`` on an Enum, for one of torchao's enums."""
    if PYTREE_ENUM not in str(record.msg) or not record.args or not isinstance(record.args, tuple):
        return False
    return str(getattr(record.args[0], "__module__", "")).split(".")[0] == "torchao"


class _Drop(logging.Filter):
    def __init__(self, match) -> None:
        super().__init__()
        self.match = match

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return not self.match(record)
        except Exception:  # a filter must never cost a record
            return True


FILTERS = {"torchao": torchao_so_line, "torch.utils._pytree": torchao_enum_line}


def install() -> None:
    """Add the filters once (a second call adds nothing)."""
    for name, match in FILTERS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.match is match for f in logger.filters):
            logger.addFilter(_Drop(match))
