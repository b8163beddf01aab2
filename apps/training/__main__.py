"""``python -m apps.training``: the training command line (``apps.training.cli``)."""

from apps.training.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
