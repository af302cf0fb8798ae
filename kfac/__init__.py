"""Distributed K-FAC preconditioner for PyTorch (Martens & Grosse 2015; KFC; KAISA's layout).

    from kfac import KFACPreconditioner
    pre = KFACPreconditioner(model)
    loss.backward(); pre.step(); optimizer.step()

Conventions, defaults and the distribution scheme: docs/kfac.md.
"""

from kfac.preconditioner import KFACPreconditioner

__all__ = ["KFACPreconditioner"]
