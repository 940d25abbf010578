"""``python -m odc.bench``: the ``odc-bench`` command line."""

from . import main

if __name__ == "__main__":
    main()
