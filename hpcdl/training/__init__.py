"""Layer 3, training: configuration, models, the schedule, the job's build, the loop and resume rules.

Imports downward only: runtime, data, run, and the kfac package.
"""
