"""Commands start quietly with the ``fp8`` extra installed (dflash.quiet): torchao's import,
which transformers does at start, prints neither its ``Failed to load ..._C_*.so`` lines nor
torch's pytree deprecation for its enums, and every other warning still shows."""

import importlib.util
import logging
import os
import subprocess
import sys
from enum import Enum

import pytest

from dflash import quiet

NOISE = ("Failed to load", "_C_", "is an Enum subclass", "register_constant")


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="the fp8 extra (torchao) is not installed")
def test_a_command_starts_without_torchaos_lines():
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "dflash.prompts", "--help"], capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: python -m dflash.prompts")
    imports = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert "torchao" in imports  # imported at start (by transformers), so its lines would be there
    rest = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert not [line for line in rest if any(n in line for n in NOISE)], "\n".join(rest)


def record(name: str, msg: str, *args) -> logging.LogRecord:
    return logging.getLogger(name).makeRecord(name, logging.WARNING, __file__, 1, msg, args, None)


class Mine(Enum):
    A = 1


def test_only_those_lines_are_dropped():
    quiet.install()
    quiet.install()  # once is enough: no second filter
    torchao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    assert len(torchao.filters) == len([f for f in torchao.filters if isinstance(f, quiet._Drop)]) == 1
    enum_msg = ("%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type. "
                "Calling register_constant() on Enum subclasses is deprecated and will be an error in a future release.")
    torchao_enum = Enum("KernelPreference", "AUTO")
    torchao_enum.__module__ = "torchao.quantization.quantize_.common.kernel_preference"
    assert not torchao.filter(record("torchao", "Failed to load /x/site-packages/torchao/_C_mxfp8.cpython-310-x86_64"
                                                "-linux-gnu.so: Could not load this library: /x/_C_mxfp8.so"))
    assert not pytree.filter(record("torch.utils._pytree", enum_msg, torchao_enum))
    # kept: torchao's other warnings, a failed load of anything else, the deprecation for anyone else's enum
    assert torchao.filter(record("torchao", "Skipping import of cpp extensions due to incompatible torch version."))
    assert torchao.filter(record("torchao", "Failed to load /x/libfoo.so: nope"))
    assert pytree.filter(record("torch.utils._pytree", enum_msg, Mine))
    assert pytree.filter(record("torch.utils._pytree", "something else %s", torchao_enum))
