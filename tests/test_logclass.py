"""Log classification: one line, and a node's log tail with torchrun's failure summary."""
from __future__ import annotations

import pytest

from backend.telemetry import logclass as lc

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

# Captured from launcher.train runs (2 CPU ranks, the tiny model): line 7 of the dataset is
# {"foo": 1}; the worker's line is 42 lines above the end of the log, out of a 40-line tail.
DATA_ERROR_TAIL = """\
[rank1] error: DataError: /tmp/fc/bad.jsonl:7: unknown record format with fields ['foo']; expected 'messages', 'instruction'+'output', 'query'+'response', 'text' or 'input_ids'
[rank0] error: DataError: /tmp/fc/bad.jsonl:7: unknown record format with fields ['foo']; expected 'messages', 'instruction'+'output', 'query'+'response', 'text' or 'input_ids'
E1201 09:09:19.331000 4548 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 4612) of binary: /root/.pyenv/versions/3.11.7/bin/python3
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "<frozen runpy>", line 88, in _run_code
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/distributed/run.py", line 1032, in <module>
    main()
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 367, in wrapper
    return f(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/distributed/run.py", line 1028, in main
    run(args)
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/distributed/run.py", line 1019, in run
    elastic_launch(
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 194, in __call__
    return launch_agent(
           ^^^^^^^^^^^^^
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
launcher.train FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-01_09:09:19
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 4613) 
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_09:09:19
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 4612) 
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""

# The end of the log of a full-training (FSDP2/DCP) run whose output_dir, a 512 KiB tmpfs, filled
# at the first checkpoint: DCP's wrapped OSError, the worker's line, torchrun's summary.
DISK_FULL_TAIL = """\
    _write_files_from_queue(
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/distributed/checkpoint/filesystem.py", line 422, in _write_files_from_queue
    with create_stream(file_name, "wb") as stream:
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/contextlib.py", line 158, in __exit__
    self.gen.throw(typ, value, traceback)
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/distributed/checkpoint/filesystem.py", line 520, in create_stream
    with path.open(mode) as stream:
OSError: [Errno 28] No space left on device

[rank0] error: No space left on device: /tmp/fc/full/run-full (0 B free of 512.0 KiB); RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598 (checkpoint, rank 0)
W1201 09:08:15.271000 3035 site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 3104 closing signal SIGTERM
E1201 09:08:15.385000 3035 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 3103) of binary: /root/.pyenv/versions/3.11.7/bin/python3
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "<frozen runpy>", line 88, in _run_code
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/distributed/run.py", line 1032, in <module>
    main()
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 367, in wrapper
    return f(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/distributed/run.py", line 1028, in main
    run(args)
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/distributed/run.py", line 1019, in run
    elastic_launch(
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 194, in __call__
    return launch_agent(
           ^^^^^^^^^^^^^
  File "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
launcher.train FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-01_09:08:15
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 3104)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 3104
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_09:08:15
  host      : localhost
  rank      : 0 (local_rank: 0)
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
    ("[rank1]: torch.distributed.DistNetworkError: failed to recv, got 0 bytes", lc.PEER_LOST),
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
    # ... and the lost store connection it logs before that, with its C++ backtrace (seen at the end
    # of tests/test_recovery.py's restarted run, which then raised a "peer lost" alert on success)
    "[W1206 15:59:38.231945559 TCPStore.cpp:115] [c10d] recvVector failed on SocketImpl(fd=3, "
    "addr=[::ffff:127.0.0.1]:37888, remote=[::ffff:127.0.0.2]:63889): Failed to recv, got 0 bytes. Connection was "
    "likely closed. Did the remote server shutdown or crash?",
    "Exception raised from recvBytes at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/Utils.hpp:787 (most recent "
    "call first):",
    "frame #2: c10::DistNetworkError::DistNetworkError(c10::SourceLocation, std::__cxx11::basic_string<char, "
    "std::char_traits<char>, std::allocator<char> >) + 0x72 (0x7f8711b7b022 in /tmp/venv/lib/python3.11/"
    "site-packages/torch/lib/libc10.so)",
    "[rank0]: frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f in libc10.so)",
])
def test_ordinary_lines_are_not_causes(line):
    assert lc.classify_line(line) is None


def test_python_exception_names_its_rank():
    cause = lc.classify_line("[rank2]: ValueError: boom")
    assert cause.rank == 2 and cause.summary == "ValueError: boom"
    assert lc.describe(cause, "node-b", 1) == "Python exception in rank 2 (node node-b, exit code 1): ValueError: boom"


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


def test_worker_error_line_names_the_user_error_and_its_rank():
    cause = lc.classify_tail(DATA_ERROR_TAIL.splitlines(), exit_code=1)
    assert cause.kind == lc.DATA_ERROR and cause.rank == 0
    assert cause.summary.startswith("/tmp/fc/bad.jsonl:7: unknown record format with fields ['foo']")
    assert lc.describe(cause, "n1") == f"data error (node n1, rank 0): {cause.summary}"


def test_every_worker_user_error_has_a_cause():
    """The worker reports each UserError by its class name; a class the control plane does not know
    would be filed as an unexplained exception."""
    import importlib

    from backend.job.errors import UserError

    for module in ("backend.job.records", "launcher.config", "launcher.model", "launcher.tokenized", "launcher.trainer"):  # define them
        importlib.import_module(module)

    def subclasses(cls):
        return {sub for direct in cls.__subclasses__() for sub in {direct} | subclasses(direct)}

    names = {cls.__name__ for cls in subclasses(UserError)}
    assert names == set(lc.USER_ERRORS), names ^ set(lc.USER_ERRORS)


def test_a_full_disk_outranks_the_sigterm_torchrun_sends_the_other_rank():
    cause = lc.classify_tail(DISK_FULL_TAIL.splitlines(), exit_code=1)
    assert cause.kind == lc.DISK_FULL, cause
    assert "/tmp/fc/full/run-full (0 B free of 512.0 KiB)" in cause.summary


@pytest.mark.parametrize("line, kind, rank", [
    # an older worker wrote user errors without their type: still a worker's error, with its rank
    ("[rank1] error: /tmp/fc/bad.jsonl:7: unknown record format with fields ['foo']", lc.PYTHON_EXCEPTION, 1),
    ("[rank1] error: ConfigError: resume: checkpoint /o/r/checkpoint-9 does not exist", lc.CHECKPOINT_ERROR, 1),
    ("[rank0] error: ModelError: model: cannot load '/nope' (not a directory)", lc.MODEL_ERROR, 0),
    ("[rank0] error: RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
     "[127.0.0.1]:60042.", lc.PEER_LOST, 0),
    # an older worker let torch.distributed.checkpoint's BaseException through
    ("[rank0]: torch.distributed.checkpoint.api.CheckpointException: CheckpointException ranks:dict_keys([0, 1])",
     lc.CHECKPOINT_ERROR, 0),
    ("[rank0]: OSError: [Errno 28] No space left on device", lc.DISK_FULL, 0),
    ("safetensors_rust.SafetensorError: Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
     "message: \"No space left on device\" })", lc.DISK_FULL, None),
])
def test_worker_lines(line, kind, rank):
    cause = lc.classify_line(line)
    assert (cause.kind, cause.rank) == (kind, rank)


# `events/rank-<N>.end` slots as launcher.train wrote them in the runs above.
DATA_SLOT = {"type": "end", "time": 1796116156.624831, "status": "failed", "step": 0,
             "error": "/tmp/fc/bad.jsonl:7: unknown record format with fields ['foo']; expected 'messages', "
                      "'instruction'+'output', 'query'+'response', 'text' or 'input_ids'",
             "error_type": "DataError", "rank": 1, "node": None, "pgid": 4548}
DCP_FULL_SLOT = {"type": "end", "time": 1796116092.3850172, "status": "failed", "step": 2,
                 "error": "No space left on device: /tmp/fc/full/run-full (0 B free of 512.0 KiB); RuntimeError: "
                          "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598 (checkpoint, rank 0)",
                 "error_type": "CheckpointException", "rank": 1, "node": None, "pgid": 2941}
PEER_ON_FULL_DISK_SLOT = {"type": "end", "time": 1796116112.5995414, "status": "failed", "step": 2,
                          "error": "No space left on device: /tmp/fc/full/run-lora (0 B free of 256.0 KiB); RuntimeError: "
                                   "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
                                   "closed by peer [127.0.0.1]:18865.",
                          "error_type": "RuntimeError", "rank": 1, "node": None, "pgid": 2941}


@pytest.mark.parametrize("slot, kind", [
    (DATA_SLOT, lc.DATA_ERROR),
    (DCP_FULL_SLOT, lc.DISK_FULL),
    (PEER_ON_FULL_DISK_SLOT, lc.DISK_FULL),
    ({**DATA_SLOT, "error_type": "ConfigError", "error": "resume: /o/r/checkpoint-2/rng-rank1.pt: cannot be read"},
     lc.CHECKPOINT_ERROR),
    ({**DATA_SLOT, "error_type": "ConfigError", "error": "learning_rate: must be positive"}, lc.CONFIG_ERROR),
    ({**DATA_SLOT, "error_type": "Diverged", "error": "loss was NaN/inf for 3 consecutive steps"}, lc.DIVERGED),
    ({**DATA_SLOT, "error_type": "OutOfMemoryError", "error": "OutOfMemoryError: CUDA out of memory."}, lc.OUT_OF_MEMORY),
    ({**DATA_SLOT, "error_type": "KeyError", "error": "KeyError: 'input_ids'"}, lc.PYTHON_EXCEPTION),
    ({**DATA_SLOT, "error_type": "CheckpointException", "error": "RuntimeError: [enforce fail at inline_container.cc:672] "
                                                                 ". unexpected pos 704 vs 598"}, lc.CHECKPOINT_ERROR),
    ({**DATA_SLOT, "error_type": "CheckpointException", "error": "OutOfMemoryError: CUDA out of memory. (on rank 0)"},
     lc.OUT_OF_MEMORY),
])
def test_end_events_name_the_cause(slot, kind):
    cause = lc.classify_end(slot)
    assert (cause.kind, cause.rank, cause.summary) == (kind, 1, slot["error"])
    assert cause.kind in lc.HELP


def test_ends_that_are_not_failures_name_nothing():
    assert lc.classify_end({**DATA_SLOT, "status": "stopped", "error": None}) is None
    assert lc.classify_end({**DATA_SLOT, "status": "succeeded", "error": None}) is None


def test_the_shown_tail_has_the_workers_lines_not_torchruns_summary():
    """A failed run's "last log lines" ended in torchrun's 40-line traceback and ChildFailedError
    summary: the worker's own error line was cut off the top."""
    lines = DATA_ERROR_TAIL.splitlines()
    shown = lc.shown_tail(lines)
    assert shown[:3] == lines[:3]  # the workers' lines and torchrun's one-line report
    assert shown[3:] == ["(torchrun's failure summary: first failure rank 0, exit code 1)"]
    assert not any("Traceback" in line or "ChildFailedError" in line for line in shown)
    assert lc.shown_tail(PYTHON_EXC.splitlines()) == PYTHON_EXC.splitlines()  # no summary: as it was
    assert lc.classify_tail(shown, exit_code=1).kind == lc.classify_tail(lines, exit_code=1).kind


STOPPED_TAIL = """\
[rank0] 2026-12-04 09:57:24,674 INFO step 4/16 loss 5.5477 lr 0.00285 grad_norm 1.02 7665 tok/s eta 0m00s
W1204 09:57:24.692000 13632 torch/distributed/elastic/agent/server/api.py:753] Received 15 death signal, shutting down workers
[rank0] 2026-12-04 09:57:24,776 INFO saved /runs/cut/checkpoint-5
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1032, in <module>
    main()
  File "/venv/lib/python3.11/site-packages/torch/distributed/elastic/agent/server/api.py", line 923, in _invoke_run
    time.sleep(monitor_interval)
  File "/venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py", line 86, in _terminate_process_handler
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)
torch.distributed.elastic.multiprocessing.api.SignalException: Process 13632 got signal: 15"""


def test_a_stops_signal_traceback_is_one_line_in_the_shown_tail():
    """A normal Stop ended the Monitor's log with torchrun's 20-line SignalException traceback."""
    lines = STOPPED_TAIL.splitlines()
    assert lc.shown_tail(lines) == lines[:3] + [
        "(torchrun ended on signal 15, as a stop ends it; its traceback is in the full log)"]
    killed = [line.replace("got signal: 15", "got signal: 9") for line in lines]
    assert lc.shown_tail(killed) == killed  # not a stop's signal: shown as it came
