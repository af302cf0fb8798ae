"""``python -m hpcdl.doctor``: the entry point; the program lives in :mod:`hpcdl.tools.doctor`."""

from hpcdl.tools.doctor import main_cli

if __name__ == "__main__":
    main_cli()
