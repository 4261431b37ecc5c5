"""Under DDP a signal reaches one process, yet every process stops, and with the same status.

The processes agree to stop through one collective after each step. Only the process that
received the signal knew its name: the others returned ``stop_signal=""`` and exited 130 (Ctrl-C's
status) where the signalled one exited 143 (SIGTERM's), so a scheduler that sent SIGTERM read
"interrupted by the user" from most of the job.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from torchvote.training.stopping import StopRequest, exit_status

# (rank -> the signal it sends itself after step 1) for each run of the test below, and the
# signal every process must report
CASES = [
    ({1: "SIGTERM"}, "SIGTERM"),  # rank 0 received nothing: it learns the name from rank 1
    ({0: "SIGINT", 1: "SIGTERM"}, "SIGTERM"),  # both: SIGTERM wins over Ctrl-C
]


def _send_after_step_1(signum: signal.Signals):
    """A training callback that sends this process ``signum`` after step 1, as a scheduler would."""

    def send(info) -> None:
        if info.step == 1:
            os.kill(os.getpid(), signum)

    return send


def _train_and_report(rank: int, world_size: int, store: str, runs: list[dict], queue) -> None:
    """One process of the run (started by ``spawn``): each run of ``runs``, its signal sent to
    itself after step 1 where the case says; ``(rank, case, interrupted, stop_signal)`` queued."""
    import torch.distributed as dist

    from torchvote.training import train
    from torchvote.training.config import config_from_dict

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        for case, ((senders, _), values) in enumerate(zip(CASES, runs, strict=True)):
            name = senders.get(rank)
            send = [] if name is None else [_send_after_step_1(signal.Signals[name])]
            result = train(config_from_dict(values), callbacks=send, verbose=False)
            queue.put((rank, case, result.interrupted, result.step, result.stop_signal))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned Python processes importing torch: ~10-20 s on 2 cores
def test_every_process_stops_with_the_status_of_the_signal_one_received(tiny_values, tmp_path):
    import torch.multiprocessing as mp

    runs = [tiny_values(tmp_path / f"run{case}", epochs=2) for case in range(len(CASES))]
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [
        context.Process(target=_train_and_report, args=(rank, 2, str(tmp_path / "store"), runs, queue))
        for rank in range(2)
    ]
    for process in processes:
        process.start()
    try:
        reports = sorted(queue.get(timeout=240) for _ in range(2 * len(CASES)))
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():  # a process left waiting in a collective: do not hang the suite
                process.kill()
    assert [process.exitcode for process in processes] == [0, 0]
    for rank, case, interrupted, step, stop_signal in reports:
        expected = CASES[case][1]
        assert interrupted and step == 1, (rank, case)  # stopped together, after the signal's step
        assert stop_signal == expected, f"rank {rank}, case {case}: {stop_signal!r}, not {expected!r}"
        assert exit_status(stop_signal) == exit_status(expected)


def test_the_highest_signal_is_agreed_and_a_callbacks_interrupt_keeps_its_name():
    """:meth:`StopRequest.agree` takes the number all processes reduced with a maximum: a process
    whose own stop names another signal (or none) reports the agreed one."""
    quiet = StopRequest(lambda line: None)
    assert quiet.signum == 0 and quiet.signal_name == ""
    quiet.agree(int(signal.SIGTERM))
    assert quiet.signal_name == "SIGTERM" and exit_status(quiet.signal_name) == 143
    assert not quiet.requested  # a Ctrl-C it gets now is its first one (which saves), not a second

    ctrl_c = StopRequest(lambda line: None)
    ctrl_c.request("SIGINT")
    assert ctrl_c.signum == int(signal.SIGINT)
    ctrl_c.agree(max(ctrl_c.signum, int(signal.SIGTERM)))  # another process got SIGTERM
    assert ctrl_c.signal_name == "SIGTERM"

    callback = StopRequest(lambda line: None)
    callback.request("KeyboardInterrupt")  # a callback raised it: counts as Ctrl-C
    callback.agree(callback.signum)
    assert callback.signal_name == "KeyboardInterrupt" and exit_status(callback.signal_name) == 130


def test_a_ctrl_c_after_agreeing_on_a_peers_stop_still_saves():
    """Agreeing on another process's stop does not count as this process's Ctrl-C: a Ctrl-C that
    reaches it while it saves (a terminal's reaches every process, not all before the exchange)
    asks again, and does not raise the "second Ctrl-C" that stops without saving."""
    with StopRequest(lambda line: None) as stop:
        stop.agree(int(signal.SIGINT))
        os.kill(os.getpid(), signal.SIGINT)  # raised KeyboardInterrupt if it counted as a second
        assert stop.requested and stop.signal_name == "SIGINT"


def test_the_signal_numbers_are_reduced_with_a_maximum_in_the_flags_exchange(tmp_path, monkeypatch):
    """The loop's one exchange per step carries the signal number beside the checkpoint flag;
    :func:`any_processes` still reads the same exchange as flags."""
    import torch.distributed as dist

    from torchvote.training.distributed import DistributedContext, any_processes, max_over_processes

    reduced = []
    real = dist.all_reduce

    def other_process_sent(tensor, op, group=None):  # a second process's values, reduced in
        reduced.append((tensor.device.type, tensor.dtype, op))
        real(tensor, op=op, group=group)
        tensor.copy_(torch.maximum(tensor, torch.tensor([15, 0], dtype=tensor.dtype)[: len(tensor)]))

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "all_reduce", other_process_sent)
        context = DistributedContext(rank=0, world_size=2, device=torch.device("meta"))
        assert max_over_processes((2, 1), context) == (15, 1)
        assert any_processes((False, True), context) == (True, True)
        assert reduced == [("cpu", torch.int32, dist.ReduceOp.MAX)] * 2  # one host exchange each
    finally:
        dist.destroy_process_group()
    assert max_over_processes((2, 0), DistributedContext()) == (2, 0)  # one process: its own values
