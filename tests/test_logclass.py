"""Log classification: one line, and a node's log tail with torchrun's failure summary."""
from __future__ import annotations

import pytest

from backend import logclass as lc

TORCHRUN_SIGKILL = """\
[rank0] 2026-11-30 04:10:26,570 INFO step 1/8 loss 5.6198 lr 9.62e-05
W1130 04:11:02.123000 123 torch/distributed/elastic/multiprocessing/api.py:900] Sending process 4242 closing signal SIGTERM
E1130 04:11:02.456000 123 torch/distributed/elastic/multiprocessing/api.py:874] failed (exitcode: -9) local_rank: 0 (pid: 4242) of binary: /usr/bin/python3
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
launcher.train FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_04:11:02
  host      : node-b
  rank      : 1 (local_rank: 0)
  exitcode  : -9 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
============================================================
"""

PYTHON_EXC = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "/x/launcher/trainer.py", line 10, in train
[rank1]:     loss = self.step(batch)
[rank1]: ValueError: expected a tensor, got None
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 0)
  exitcode  : 1 (pid: 77)
"""

PEER_LOST = """\
[rank0]: Traceback (most recent call last):
[rank0]: RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.3]:43210
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 88)
"""


@pytest.mark.parametrize("line, kind", [
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", lc.OUT_OF_MEMORY),
    ("RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 123 bytes", lc.OUT_OF_MEMORY),
    ("[rank3]:[E ProcessGroupNCCL.cpp:616] [Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE)", lc.NCCL_TIMEOUT),
    ("node1:123:456 [0] NCCL WARN socket recv timed out", lc.NCCL_TIMEOUT),
    ("  traceback : Signal 9 (SIGKILL) received by PID 4242", lc.KILLED),
    ("[rank2]: ValueError: boom", lc.PYTHON_EXCEPTION),
    ("RuntimeError: Connection reset by peer", lc.PEER_LOST),
    ("torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError", lc.RENDEZVOUS_FAILED),
    ("/usr/bin/python3: No module named launcher.train", lc.COMMAND_NOT_FOUND),
    ("bash: line 1: torchrun: command not found", lc.COMMAND_NOT_FOUND),
])
def test_classify_line(line, kind):
    cause = lc.classify_line(line)
    assert cause is not None and cause.kind == kind


@pytest.mark.parametrize("line", [
    "[rank0] 2026-11-30 04:10:26,570 INFO step 1/8 loss 5.6198",
    "  File \"/x/y.py\", line 3, in f",
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
    "",
    # torchrun at the end of a successful 2-node run whose store node had already left.
    "W1130 07:01:40.512000 2941 site-packages/torch/distributed/elastic/rendezvous/dynamic_rendezvous.py:1294] "
    "The node 'n1_2941_0' has failed to shutdown the rendezvous '20261130-070051-17ee29' due to an error of type "
    "RendezvousConnectionError.",
])
def test_ordinary_lines_are_not_causes(line):
    assert lc.classify_line(line) is None


def test_python_exception_names_its_rank():
    cause = lc.classify_line("[rank2]: ValueError: boom")
    assert cause.rank == 2 and cause.summary == "ValueError: boom"
    assert lc.describe(cause, "node-b", 1) == "Python exception in rank 2 (node node-b, rank 2, exit code 1): ValueError: boom"


def test_tail_sigkill_is_killed_with_rank():
    cause = lc.classify_tail(TORCHRUN_SIGKILL.splitlines(), exit_code=1)
    assert cause.kind == lc.KILLED
    assert cause.rank == 1


def test_tail_exception_is_the_last_exception_line():
    cause = lc.classify_tail(PYTHON_EXC.splitlines(), exit_code=1)
    assert cause.kind == lc.PYTHON_EXCEPTION and cause.rank == 1
    assert "expected a tensor" in cause.summary


def test_peer_lost_ranks_below_a_root_cause():
    peer = lc.classify_tail(PEER_LOST.splitlines(), 1)
    killed = lc.classify_tail(TORCHRUN_SIGKILL.splitlines(), 1)
    assert peer.kind == lc.PEER_LOST
    assert killed.priority > peer.priority


def test_tail_without_clues_uses_the_exit_code():
    assert lc.classify_tail(["nothing here"], 137).kind == lc.KILLED
    unknown = lc.classify_tail(["nothing here"], 3)
    assert unknown.kind == lc.UNKNOWN and "exit code 3" in unknown.summary


def test_torchrun_stop_signal_is_not_an_error():
    # What torchrun logs when the studio stops a run: not a Python exception in the training code.
    line = "torch.distributed.elastic.multiprocessing.api.SignalException: Process 4242 got signal: 15"
    assert lc.classify_line(line) is None
    killed = lc.classify_line(line.replace("signal: 15", "signal: 9"))
    assert killed is not None and killed.kind == lc.KILLED
