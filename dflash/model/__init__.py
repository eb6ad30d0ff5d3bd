"""The networks: the drafter and its block layout, its linear layer, the frozen target
(loading, prefill, head), and the z-lab export.

May import the leaves (:mod:`dflash.compile`, :mod:`dflash.files`), never training
code: evaluation and the export share only these definitions with training.
"""
