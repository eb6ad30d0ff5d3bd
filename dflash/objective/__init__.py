"""The training objective as pure tensor code: anchors and blocks, the DFlash attention
mask, the decay-weighted loss and its pass over the vocabulary.

Imports torch and :mod:`dflash` leaves only; nothing here knows about models,
data files, processes or configs.
"""
