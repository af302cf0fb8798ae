"""``python -m hpcdl.train``: the entry point; the program lives in :mod:`hpcdl.training.train`."""

from hpcdl.training.train import main_cli

if __name__ == "__main__":
    main_cli()
