"""``python -m mfqat``: the `mfqat` command."""
from mfqat.cli.app import main

main()
