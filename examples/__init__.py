"""Tasks that train with ``python -m hpcdl.train --task examples.<module>:<function>`` (docs/training.md)."""
