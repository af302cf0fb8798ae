"""``python -m hpcdl.plot``: the entry point; the program lives in :mod:`hpcdl.tools.plot`."""

from hpcdl.tools.plot import main_cli

if __name__ == "__main__":
    main_cli()
