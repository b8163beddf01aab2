"""``python -m apps.parity``: the parity report command line (``apps.parity.cli``)."""

from apps.parity.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
