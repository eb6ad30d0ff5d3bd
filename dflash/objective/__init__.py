"""The training objective as pure tensor code: anchors and blocks, the DFlash attention
mask, the decay-weighted loss and its pass over the vocabulary, and the one frozen
object of its settings (:class:`~dflash.objective.config.ObjectiveConfig`).

Imports torch and :mod:`dflash` leaves only; nothing here knows about models,
data files, processes or the Hydra config.
"""
