"""Regenerate the assistant turns of a chat data set with the target itself.

    python -m dflash.regenerate target=qwen3_8b target.path=/models/Qwen3-8B data.path=prompts.jsonl \\
        --out data/regen.jsonl [--temperature T] [--top-p P] [--max-new-tokens N] [--thinking on|off]
    torchrun --nproc_per_node=8 -m dflash.regenerate ...        # one shard of the records per GPU
    python -m dflash.regenerate data.path=prompts.jsonl --out data/regen.jsonl --server http://localhost:8000
    python -m dflash.regenerate data.path=prompts.jsonl --out data/regen.jsonl --merge [--keep-truncated]
    python -m dflash.regenerate target=qwen3_8b target.path=random --throughput 256 --batch-size 64

The DFlash recipe trains the drafter on what the target itself answers, so that it
learns the target's distribution rather than the data set's. Every assistant turn is
regenerated in order, with the replies regenerated before it as context; a record that
ends in a user turn gets one reply more, so a bare prompt set works as well.

Each rank appends one line per finished record to its shard file in ``<out>.parts/``,
flushed and fsynced after every batch, and a restart skips the records any shard file
already holds: a crash costs at most the batch in flight, and nothing is written twice.
Records are keyed by their own ``id`` or else by ``file:line``. Rank ``r`` of ``W`` takes
the windows of ``batch_size x window`` consecutive records whose number is ``r`` modulo
``W``; a window's prompts are sorted by length and batched the same way whatever ``W``,
so a greedy run gives the same file on any number of ranks. When every shard is done
(rank 0, after a barrier over gloo; or ``--merge`` later), the output is written in
input order in one rename. A reply that reaches ``--max-new-tokens`` without the
end-of-turn token is counted and dropped (``--keep-truncated`` keeps it); the merge
decides, so the same shards can be merged either way.
"""
