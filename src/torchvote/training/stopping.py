"""Stopping a run cleanly: Ctrl-C and SIGTERM ask the loop to save and stop after the step."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["RunInterrupted", "StopRequest", "exit_status"]


def exit_status(reason: str) -> int:
    """The shell's status for a process a signal stopped: 128 plus its number (``SIGTERM``: 143).

    Args:
        reason: the signal's name, as :attr:`StopRequest.reason` holds it; anything else
            (``""``, ``"KeyboardInterrupt"``) counts as Ctrl-C.

    Returns:
        143 for ``"SIGTERM"``; 130 (``SIGINT``) otherwise.
    """
    signum = signal.Signals.__members__.get(reason, signal.SIGINT)
    return 128 + int(signum)


class RunInterrupted(KeyboardInterrupt):
    """A run a signal stopped after saving its checkpoint, raised where the caller goes no further.

    Args:
        message: what to tell the user (where the run stopped, how to go on).
        stop_signal: the signal's name (``"SIGINT"``, ``"SIGTERM"``), for :func:`exit_status`.
    """

    def __init__(self, message: str, stop_signal: str = "") -> None:
        super().__init__(message)
        self.stop_signal = stop_signal


class StopRequest:
    """While entered, SIGINT and SIGTERM set :attr:`requested` instead of killing the process;
    a second Ctrl-C raises ``KeyboardInterrupt`` at once (no checkpoint). The previous handlers
    come back on exit. Outside the main thread no handler is installed. Processes forked while it
    is entered (``DataLoader`` workers, which a terminal's Ctrl-C reaches too) inherit the handler
    but ignore the signal: the loop stops them when it stops.

    Args:
        log: prints one line (on rank 0) when a signal arrives.
    """

    def __init__(self, log: Callable[[str], None]) -> None:
        self.requested = False
        self.reason = ""
        self._log = log
        self._previous: dict[int, Any] = {}
        self._pid = os.getpid()

    def request(self, reason: str) -> None:
        """Ask the loop to stop after the current step."""
        self.requested, self.reason = True, reason

    def _handle(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:  # a forked worker: not the loop, nothing to save or say
            return
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.request(signal.Signals(signum).name)
        # a second Ctrl-C stops at once; a SIGTERM comes from a scheduler or kill, not a keyboard
        at_once = " (press Ctrl-C again to stop at once without saving)" if signum == signal.SIGINT else ""
        self._log(f"{self.reason} received: saving a checkpoint after this step{at_once}")

    def __enter__(self) -> StopRequest:
        self._pid = os.getpid()
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
