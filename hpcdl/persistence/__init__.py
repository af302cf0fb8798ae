"""Layer 2, persistence: what a run leaves on disk (the run directory and its lock, checkpoints, metrics, result files).

Sees only stateful objects (``state_dict``/``load_state_dict``) and the communicator, never the
training job. Imports the runtime layer only.
"""
