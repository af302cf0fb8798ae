"""Layer 0, the process runtime: who this rank is, where it runs, and how it fails.

The in-rank layer: world and placement (ranks, devices, cores), launcher variables, the rendezvous,
signals, the stall watchdog, fault injection for tests, error classes and the rank-0 console. What starts
the ranks is hpcdl.launching's, whose rule for sharing a host's cores among its ranks (hpcdl.launching.cores)
world and placement read; it imports nothing else of hpcdl.
"""
