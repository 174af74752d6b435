"""The command line: `compress run | eval | inspect | export | verify | report | plan | speculate | draft-head`;
argument parsing only."""
from .commands import main

__all__ = ["main"]
