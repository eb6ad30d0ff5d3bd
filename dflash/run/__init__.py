"""A training run: the config and the frozen plan, the builders, the roles and their
step loop, the drafter trainer, checkpoints, metrics, start-up timing, garbage collection
at step boundaries, the cost model and the choice of layout.

The top of the library: imports every other package. Only :mod:`dflash.run.config`
and the builders read the Hydra config; what they hand down is frozen objects.
"""
