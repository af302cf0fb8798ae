"""The lowest layer (under the runtime's layer 0), before any rank exists: what the launch scripts' words mean
and which command starts the ranks.

The parser (args), the decisions (plan) and each rank's words (rank_command) behind ``python -m hpcdl.launch``,
and the share of a host's cores each rank gets (cores), which the runtime's world and placement read too.
Standard library only and imports nothing else of hpcdl: it runs before a virtual environment is known.
"""
