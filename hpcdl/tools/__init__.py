"""Layer 4, command-line tools beside training: doctor, pack, plot, fetch_mnist.

Each is run as ``python -m hpcdl.<tool>`` through the entry modules at the package root.
"""
