"""The command line's exit: a reader that goes away (``... | head``) ends a command quietly."""
from __future__ import annotations

import os
import sys


def silence_stdout() -> None:
    """Point stdout at os.devnull: what is left to print once its reader went away goes
    nowhere, and Python's final flush at exit cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def run(command, argv=None) -> int:
    """``command(argv)``'s exit status; a reader that goes away (``... | head``) ends it
    quietly with 141, the status of a Unix tool stopped by SIGPIPE, not a traceback."""
    try:
        try:
            return command(argv)
        finally:  # argparse's --help and errors exit: flush here, not at interpreter exit
            sys.stdout.flush()
    except BrokenPipeError:
        silence_stdout()
        return 141  # 128 + SIGPIPE
