"""``python -m hpcdl.fetch_mnist``: the entry point; the program lives in :mod:`hpcdl.tools.fetch_mnist`."""

from hpcdl.tools.fetch_mnist import main_cli

if __name__ == "__main__":
    main_cli()
