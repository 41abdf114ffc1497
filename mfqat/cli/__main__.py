"""``python -m mfqat.cli``: the `mfqat` command."""
from mfqat.cli.app import main

main()
