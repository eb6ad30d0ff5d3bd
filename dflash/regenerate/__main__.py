"""``python -m dflash.regenerate`` (see :mod:`dflash.regenerate`)."""

from dflash.regenerate.run import main

if __name__ == "__main__":
    main()
