"""Layer 0, before any rank exists: what the launch scripts' words mean and which command starts the ranks.

The parser (args), the decisions (plan) and each rank's words (rank_command) behind
``python -m hpcdl.launch``. Standard library only and imports nothing else of hpcdl: it runs before a
virtual environment is known.
"""
