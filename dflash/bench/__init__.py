"""Throughput of both roles at real shapes, side by side in one run.

    python -m dflash.bench [--steps N] [--out FILE] [key=value ...]
    python -m dflash.bench target=qwen3_8b train=paper          # the Qwen3-8B bars
    python -m dflash.bench --warmup-procs 4 compile.enabled=true train.buckets=[320]
    python -m dflash.bench --p2p target=qwen3_8b train=paper    # two GPUs: bundle bandwidth
    python -m dflash.bench --decode 64x256 target=qwen3_8b      # decoding speed: the live evaluation
    python -m dflash.bench --train-ranks 8 target=qwen3_8b target.path=random data=synthetic train=paper

Weights are random (speed does not depend on them): the target comes from the
``shape`` of its ``conf/target`` entry, or from the shipped model's config.json.
Reported: the drafter step (one micro-batch forward/backward plus the optimizer)
eager, compiled and compiled with CUDA graphs; the target prefill eager and
compiled; the colocated pipeline; peak memory and warmup time of each, with the
compile time per stage; last, the compiled drafter's warmup once more from the
compile cache on disk (a warm start, as a second launch). MFU uses
the FLOP count of docs/DESIGN.md section 6 (printed with the table) over
``--peak-tflops``. ``--warmup-procs N`` instead times the compile warmup of N
drafter processes on this machine, each with its own compile cache, all at once
against staggered (later turns receive the first rank's compiled code); ``--p2p``
sends bundles of the configured shapes between two local ranks (NCCL on two
GPUs, gloo on the CPU) against a raw send of the same bytes. ``--decode NxM`` (several,
comma-separated) instead times what an evaluation decodes: N random prompts of 64-512
tokens, M new tokens each (no stop token), speculative with a random drafter in batches
of ``eval.batch_size`` and at batch 1, and the plain greedy baseline; a random drafter
accepts about one token per cycle, the slowest case. ``--train-ranks N`` instead trains
under torchrun on N local ranks (one per GPU) in the layout the plan takes for them, and
reports the samples/s per GPU of the last ``--steps`` optimizer steps beside the plan's
prediction: the figure of a layout on several GPUs, step to step as training logs it.
"""
