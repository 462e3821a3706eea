"""The argument parser every command line of the project uses (peer.run, peer.eval, peer.admit, peer.status,
peer.plot, dht_bootstrap): a bad flag is one line and exit 2, and no flag is taken by an abbreviation. Imports
argparse only, so a command that must start fast (peer.admit) stays fast."""
from __future__ import annotations

import argparse
from typing import Any


class OneLineParser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # --max-step is a typo, not --max-steps
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # one line, not usage + error
        self.exit(2, f"{self.prog}: error: {message}\n")
