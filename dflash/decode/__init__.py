"""Real speculative decoding with a target and a drafter: tau, the acceptance
histogram, the lossless check; and the same decoding while training.

May import :mod:`dflash.model`, the records and template modules of
:mod:`dflash.data`, and :mod:`dflash.distributed` (the evaluation link); never the
training runtime (:mod:`dflash.run`, :mod:`dflash.objective`).
"""
