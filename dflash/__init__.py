"""dflash: train DFlash block-diffusion drafters for lossless speculative decoding."""

import time

STARTED = time.monotonic()  # the start-up log counts its phases from here (dflash.run.startup)

from dflash import quiet  # noqa: E402  (after STARTED: the start-up log counts from the first line)

quiet.install()  # torchao's import-time noise, before anything imports transformers
