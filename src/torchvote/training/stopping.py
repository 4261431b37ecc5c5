"""Stopping a run cleanly: Ctrl-C and SIGTERM ask the loop to save and stop after the step."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["RunInterrupted", "StopRequest", "exit_status", "signal_number"]


def signal_number(reason: str) -> int:
    """The number of the signal a stop reason names.

    Args:
        reason: the signal's name, as :attr:`StopRequest.reason` holds it; anything else
            (``""``, ``"KeyboardInterrupt"``) counts as Ctrl-C.

    Returns:
        15 for ``"SIGTERM"``; 2 (``SIGINT``) otherwise.
    """
    return int(signal.Signals.__members__.get(reason, signal.SIGINT))


def exit_status(reason: str) -> int:
    """The shell's status for a process a signal stopped: 128 plus its number (``SIGTERM``: 143).

    Args:
        reason: as in :func:`signal_number`.

    Returns:
        143 for ``"SIGTERM"``; 130 (``SIGINT``) otherwise.
    """
    return 128 + signal_number(reason)


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
        self.agreed = ""
        self._log = log
        self._previous: dict[int, Any] = {}
        self._pid = os.getpid()

    def request(self, reason: str) -> None:
        """Ask the loop to stop after the current step."""
        self.requested, self.reason = True, reason

    @property
    def signum(self) -> int:
        """The number of the signal that asked this process to stop (:func:`signal_number`: a
        callback's ``KeyboardInterrupt`` counts as SIGINT); 0 while nothing did. The processes of
        a run exchange it and stop on the highest (:meth:`agree`)."""
        return signal_number(self.reason) if self.requested else 0

    def agree(self, signum: int) -> None:
        """Record the stop all processes agreed on, the highest of their :attr:`signum`: SIGTERM
        (15) wins over Ctrl-C (2), as a scheduler that sent SIGTERM to one process reads the exit
        status (143) of each. Without it a process that received no signal itself exited 130.

        This process's own :attr:`reason` is kept where it names the same signal (a callback's
        ``KeyboardInterrupt`` stays one); :attr:`requested` is not set: a Ctrl-C that reaches this
        process afterwards is its first, which saves, not a second, which stops without saving.

        Args:
            signum: the agreed signal's number, a :attr:`signum` of some process (not 0).
        """
        own = self.reason if self.signum == signum else ""
        self.agreed = own or signal.Signals(signum).name

    @property
    def signal_name(self) -> str:
        """The stop's reason to report and exit with (:func:`exit_status`): the one the processes
        agreed on, else this process's own (``""``: none)."""
        return self.agreed or self.reason

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
