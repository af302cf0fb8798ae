"""Layer 0, the process runtime: who this rank is, where it runs, and how it fails.

World and placement (ranks, devices, cores), launcher variables, signals, the stall watchdog,
fault injection for tests, error classes and the rank-0 console; and what starts the ranks: the launch
scripts' parser, decisions and rank words (launch_args, launch_plan, rank_command; ``python -m hpcdl.launch``).
Imports nothing else of hpcdl.
"""
