"""`err`: the console every command writes its messages on (stderr; stdout is the command's
output)."""

from rich.console import Console

err = Console(stderr=True, highlight=False, soft_wrap=True)  # one-line messages stay one line
