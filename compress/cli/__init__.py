"""The command line: `compress run | eval | inspect | export | verify | report | plan | speculate`; argument parsing only."""
from .commands import main

__all__ = ["main"]
