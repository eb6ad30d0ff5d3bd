"""From files to micro-batches: reading records, the chat template, tokenising and
its cache, the seeded sample order, collation, and the bundle's field table.

May import :mod:`dflash.objective` (anchors are drawn where the data is made) and
:mod:`dflash.model` (what a prefill returns). Decoding imports only the records
and template modules, which import neither.
"""
