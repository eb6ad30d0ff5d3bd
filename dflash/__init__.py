"""dflash: train DFlash block-diffusion drafters for lossless speculative decoding."""
