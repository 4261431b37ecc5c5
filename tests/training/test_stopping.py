"""Stopping cleanly: the signal handlers of the loop, in the loop's process and in its workers."""

from __future__ import annotations

import os
import signal

from torchvote.training.stopping import StopRequest


def test_a_forked_worker_ignores_the_signal_and_says_nothing():
    """A terminal's Ctrl-C reaches every process of the foreground group, ``DataLoader`` workers
    included, which inherit the loop's handler when they are forked: each printed "SIGINT
    received: saving a checkpoint" (the message came once per worker, plus the loop's)."""
    said: list[str] = []
    before = signal.getsignal(signal.SIGINT)
    with StopRequest(said.append) as stop:
        pid = os.fork()
        if pid == 0:  # the worker: report through the exit status only
            os.kill(os.getpid(), signal.SIGINT)
            os._exit(10 * int(stop.requested) + int(bool(said)))
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the worker took the signal as the loop's"
        assert not stop.requested and said == []
        os.kill(os.getpid(), signal.SIGINT)  # the loop's own process still takes it
        assert stop.requested and stop.reason == "SIGINT" and len(said) == 1
    assert signal.getsignal(signal.SIGINT) is before


def test_only_ctrl_c_is_told_to_press_ctrl_c_again():
    """A SIGTERM (a scheduler's, or kill's) was answered "press Ctrl-C again to stop at once"."""
    said: list[str] = []
    with StopRequest(said.append):
        os.kill(os.getpid(), signal.SIGTERM)
    with StopRequest(said.append):
        os.kill(os.getpid(), signal.SIGINT)
    assert said == [
        "SIGTERM received: saving a checkpoint after this step",
        "SIGINT received: saving a checkpoint after this step "
        "(press Ctrl-C again to stop at once without saving)",
    ]


def test_the_exit_status_is_the_shells_for_the_signal():
    """A SIGTERM'd run exited 130, the status of Ctrl-C: a scheduler reading 143 (128 + 15) as
    "terminated" took it for a user's interrupt."""
    from torchvote.training.stopping import exit_status

    assert exit_status("SIGTERM") == 128 + signal.SIGTERM == 143
    assert exit_status("SIGINT") == 128 + signal.SIGINT == 130
    assert exit_status("") == exit_status("KeyboardInterrupt") == 130  # no signal: as Ctrl-C
