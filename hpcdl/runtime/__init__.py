"""Layer 0, the process runtime: who this rank is, where it runs, and how it fails.

World and placement (ranks, devices, cores), launcher variables, signals, the stall watchdog,
fault injection for tests, error classes and the rank-0 console. Imports nothing else of hpcdl.
"""
