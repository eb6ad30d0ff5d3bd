"""Processes working as one job: who does what (topology), the cross-rank phases and
the control plane (protocol), bundles over point-to-point (transport), and the
deadlines on every wait (watchdog).

May import :mod:`dflash.data` (the bundle's fields) and the leaves.
"""
