"""dflash: train DFlash block-diffusion drafters for lossless speculative decoding."""

import time

STARTED = time.monotonic()  # the start-up log counts its phases from here (dflash.run.startup)
