"""``python -m ganpipe_cli``: the ``ganpipe`` command without its console script."""

from ganpipe_cli import main

main()
