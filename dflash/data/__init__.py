"""From files to micro-batches.

- :mod:`~dflash.data.records`: finding and reading the data files, records as conversations.
- :mod:`~dflash.data.template`: the chat template, prompts to token ids, the tokens that end a reply.
- :mod:`~dflash.data.dataset`: tokenising with loss masks, mixing, the skip report, :class:`DataSettings`.
- :mod:`~dflash.data.token_cache`: the tokenised dataset cached on disk.
- :mod:`~dflash.data.order`: the seeded sample order and collation into buckets, anchors drawn.
- :mod:`~dflash.data.bundle`: the bundle's field table, random batches.

``order`` and ``bundle`` may import :mod:`dflash.objective` (anchors are drawn where
the data is made) and ``bundle`` :mod:`dflash.model` (what a prefill returns).
Decoding and regeneration import only ``records`` and ``template``, which import
neither, nor :mod:`dflash.run`.
"""
