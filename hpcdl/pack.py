"""``python -m hpcdl.pack``: the entry point; the program lives in :mod:`hpcdl.tools.pack`."""

from hpcdl.tools.pack import main_cli

if __name__ == "__main__":
    main_cli()
