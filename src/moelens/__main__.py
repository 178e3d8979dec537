"""``python -m moelens``: the command line, as the ``moelens`` console script runs it."""

from .cli import main

raise SystemExit(main())
