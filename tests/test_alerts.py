"""Every alert rule on recorded series: one case that fires, one that stays quiet."""
from __future__ import annotations

from backend.telemetry import alerts
from backend.telemetry.alerts import AlertConfig, Window

CFG = AlertConfig()
HANG_10S = AlertConfig(hang_s=10)
T0 = 1_700_000_000.0


def util_series(values, start=T0, dt=1.0):
    return [(start + i * dt, v) for i, v in enumerate(values)]


def timing(rank, step, step_time, cw=0.0, dw=0.0, t=None):
    return {"type": "timing", "rank": rank, "step": step, "time": t if t is not None else T0 + step,
            "step_time_s": step_time, "collective_wait_s": cw, "data_wait_s": dw}


def train(step, loss, grad_norm=1.0, t=None, nonfinite=None):
    return {"type": "train", "step": step, "time": t if t is not None else T0 + step, "loss": loss,
            "grad_norm": grad_norm, "nonfinite": nonfinite or {}}


def window(now, **kw):
    kw.setdefault("running", True)
    kw.setdefault("started_t", T0)
    return Window(now=now, **kw)


# -- low utilisation -----------------------------------------------------------------------------

def test_low_utilisation_fires_and_names_communication_bound():
    w = window(T0 + 90, util={("a", 0): util_series([20.0] * 91), ("a", 1): util_series([35.0] * 91)},
               timing={0: [timing(0, 10, 1.0, cw=0.6, dw=0.05, t=T0 + 80)],
                       1: [timing(1, 10, 1.0, cw=0.5, dw=0.05, t=T0 + 80)]})
    [f] = alerts.low_utilisation(w, CFG)
    assert f.rule == "low_utilisation" and f.severity == "warning"
    assert "communication-bound" in f.message and "55%" in f.message
    assert "a:0" in f.message and "a:1" in f.message and "2 GPU(s)" in f.message


def test_low_utilisation_names_input_bound():
    w = window(T0 + 90, util={("a", 0): util_series([10.0] * 91)},
               timing={0: [timing(0, 10, 2.0, cw=0.1, dw=1.2, t=T0 + 85)]})
    [f] = alerts.low_utilisation(w, CFG)
    assert "input-bound" in f.message and "60%" in f.message
    assert (f.node, f.gpu) == ("a", 0)


def test_low_utilisation_quiet_when_short_busy_or_not_running():
    short = window(T0 + 40, util={("a", 0): util_series([10.0] * 41)})  # only 40 s of low samples
    assert alerts.low_utilisation(short, CFG) == []
    dip = [95.0] * 50 + [10.0] * 41  # high until 41 s ago
    assert alerts.low_utilisation(window(T0 + 90, util={("a", 0): util_series(dip)}), CFG) == []
    busy = window(T0 + 90, util={("a", 0): util_series([90.0] * 91)})
    assert alerts.low_utilisation(busy, CFG) == []
    stopped = window(T0 + 90, running=False, util={("a", 0): util_series([5.0] * 91)})
    assert alerts.low_utilisation(stopped, CFG) == []
    # low before the run started (model loading) does not count
    loading = window(T0 + 90, started_t=T0 + 50, util={("a", 0): util_series([5.0] * 91)})
    assert alerts.low_utilisation(loading, CFG) == []


# -- NaN / inf -----------------------------------------------------------------------------------

def test_non_finite_loss_and_grad_norm_fire_with_step_and_checkpoint():
    # as the worker writes them: null values, named in `nonfinite`
    w = window(T0 + 50, train=[train(1, 2.0), train(2, None, nonfinite={"loss": "nan"}),
                               train(3, 1.9, grad_norm=None, nonfinite={"grad_norm": "inf"})],
               checkpoint=(1, "/runs/x/checkpoint-1"))
    found = {f.key: f for f in alerts.non_finite(w, CFG)}
    assert set(found) == {"non_finite:loss", "non_finite:grad_norm"}
    assert "step 2" in found["non_finite:loss"].message and "checkpoint-1" in found["non_finite:loss"].message
    assert "step 3" in found["non_finite:grad_norm"].message
    assert found["non_finite:loss"].severity == "error"


def test_non_finite_quiet_on_finite_values_and_missing_grad_norm():
    w = window(T0 + 50, train=[train(1, 2.0), train(2, 1.5, grad_norm=None), train(3, 0.0)])
    assert alerts.non_finite(w, CFG) == []


# -- loss spike ----------------------------------------------------------------------------------

def test_loss_spike_fires_at_the_spike_step():
    losses = [2.0, 1.9, 1.95, 1.85, 1.8, 1.82, 1.78, 1.75, 5.0, 1.7]
    w = window(T0 + 20, train=[train(i + 1, v) for i, v in enumerate(losses)])
    [f] = alerts.loss_spike(w, CFG)
    assert f.key == "loss_spike:9" and "step 9" in f.message


def test_loss_spike_quiet_on_noisy_but_steady_and_on_short_history():
    noisy = [2.0, 1.2, 2.3, 1.1, 2.2, 1.3, 2.1, 1.2, 2.4, 1.25]  # jumps ~2x, but always did
    assert alerts.loss_spike(window(T0 + 20, train=[train(i + 1, v) for i, v in enumerate(noisy)]), CFG) == []
    short = [1.0, 1.0, 9.0]
    assert alerts.loss_spike(window(T0 + 20, train=[train(i + 1, v) for i, v in enumerate(short)]), CFG) == []


# -- hang ----------------------------------------------------------------------------------------

def test_hang_fires_and_names_the_rank_behind():
    ev = [train(s, 1.0, t=T0 + s) for s in range(1, 11)]
    w = window(T0 + 10 + 400, train=ev,
               timing={0: [timing(0, 10, 1.0, t=T0 + 10)], 1: [timing(1, 8, 1.0, t=T0 + 8)],
                       2: [timing(2, 10, 1.0, t=T0 + 10)]},
               placement={1: ("node-b", 3)})
    [f] = alerts.hang(w, CFG)
    assert f.rule == "hang" and (f.rank, f.node, f.gpu) == (1, "node-b", 3)
    assert "400 s" in f.message and "rank 1, node node-b, GPU 3" in f.message


def test_an_evaluation_that_reports_is_progress_not_a_hang():
    ev = [train(s, 1.0, t=T0 + s) for s in range(1, 11)]
    idle = window(T0 + 10 + 400, train=ev)
    assert alerts.hang(idle, CFG)
    # A long evaluation after step 10 writes `eval` events meanwhile: no hang until they stop coming.
    assert alerts.hang(window(T0 + 10 + 400, train=ev, evaluated=(T0 + 350, 10)), CFG) == []
    [f] = alerts.hang(window(T0 + 350 + 400, train=ev, evaluated=(T0 + 350, 10)), CFG)
    assert "(last logged step 10)" in f.message


def test_hang_names_the_rank_whose_process_is_stopped_or_in_uninterruptible_io():
    # gloo: every rank logged the same last step, so only the process states tell them apart
    ev = [train(s, 1.0, t=T0 + s) for s in range(1, 11)]
    steps = {r: [timing(r, 10, 1.0, t=T0 + 10)] for r in range(3)}
    w = window(T0 + 30, train=ev, timing=steps, placement={1: ("node-b", None), 2: ("node-c", 0)},
               rank_states={0: ("running", T0 + 1), 1: ("stopped", T0 + 11), 2: ("running", T0 + 1)})
    [f] = alerts.hang(w, HANG_10S)
    assert (f.rank, f.node) == (1, "node-b")
    assert ("rank 1, node node-b has been stopped (SIGSTOP, a debugger or job control) for 19 s: the other ranks "
            "wait for it") in f.message
    w.rank_states.update({1: ("running", T0 + 1), 2: ("disk_sleep", T0 + 12)})
    [f] = alerts.hang(w, HANG_10S)
    assert (f.rank, f.node, f.gpu) == (2, "node-c", 0) and "uninterruptible I/O (D state" in f.message
    # a brief D state (an ordinary read) and a state from before this attempt name nobody
    for states in ({2: ("disk_sleep", T0 + 29)}, {1: ("stopped", T0 - 5)}):
        w.rank_states.clear()
        w.rank_states.update(states)
        [f] = alerts.hang(w, HANG_10S)
        assert f.rank is None and "has been" not in f.message
    # two halted ranks are both named, and neither is taken for the one rank to blame
    w.rank_states.update({1: ("stopped", T0 + 11), 2: ("stopped", T0 + 11)})
    [f] = alerts.hang(w, HANG_10S)
    assert f.rank is None and "rank 1, node node-b has been stopped" in f.message
    assert "rank 2, node node-c, GPU 0 has been stopped" in f.message and "wait for it" not in f.message


def test_hang_names_a_rank_behind_and_stopped_once():
    ev = [train(s, 1.0, t=T0 + s) for s in range(1, 11)]
    w = window(T0 + 30, train=ev, timing={0: [timing(0, 10, 1.0, t=T0 + 10)], 1: [timing(1, 9, 1.0, t=T0 + 9)]},
               placement={1: ("node-b", None)}, rank_states={1: ("stopped", T0 + 10)})
    [f] = alerts.hang(w, HANG_10S)
    assert (f.rank, f.node) == (1, "node-b") and f.message.count("rank 1") == 1
    assert ("rank 1, node node-b last reported step 9 while other ranks reached 10 and has been stopped (SIGSTOP, "
            "a debugger or job control) for 20 s: the other ranks wait for it") in f.message
    # every rank stopped, one of them a step behind where the signal found it: none is the cause
    w.rank_states[0] = ("stopped", T0 + 10)
    [f] = alerts.hang(w, HANG_10S)
    assert (f.rank, f.node) == (None, None) and "last reported step 9" not in f.message
    assert "rank 0 has been stopped" in f.message and "rank 1, node node-b has been stopped" in f.message
    # one node's ranks halted (its filesystem), the other node's running: the one behind names that node
    steps = {0: [timing(0, 10, 1.0, t=T0 + 10)], 1: [timing(1, 10, 1.0, t=T0 + 10)],
             2: [timing(2, 10, 1.0, t=T0 + 10)], 3: [timing(3, 9, 1.0, t=T0 + 9)]}
    w = window(T0 + 30, train=ev, timing=steps, placement={0: ("node-a", None), 1: ("node-a", None),
                                                           2: ("node-b", None), 3: ("node-b", None)},
               rank_states={2: ("disk_sleep", T0 + 10), 3: ("disk_sleep", T0 + 10)})
    [f] = alerts.hang(w, HANG_10S)
    assert (f.rank, f.node) == (3, "node-b"), f.message


def flight(rank, seq, last, in_flight=True, group="0", collective="gloo:all_reduce", request="q1", entries=5,
           groups=None):
    """A rank's answer to the watch's flight recorder request, as the agent sends it."""
    return {"kind": "flight", "t": T0, "rank": rank, "requested": True, "request": request, "collective": collective,
            "seq": seq, "in_flight": in_flight, "group": group, "process_group": [group, "default_pg"],
            "last_seq": {group: last} if last is not None else {}, "entries": entries,
            "groups": groups if groups is not None else [group]}


def test_hang_names_the_collective_the_ranks_wait_in_and_the_rank_that_never_entered_it():
    ev = [train(s, 1.0, t=T0 + s) for s in range(1, 11)]
    seen = {r: T0 - 5 for r in range(4)}  # seen while loading, before the `start` event
    answers = {0: flight(0, 7, 7), 2: flight(2, 7, 7), 1: flight(1, 6, 6, in_flight=False)}  # rank 3: no answer
    w = window(T0 + 30, train=ev, placement={1: ("node-b", None)}, flights=answers, rank_seen=seen,
               flight_request="q1", attempt_t=T0 - 10)
    [f] = alerts.hang(w, HANG_10S)
    assert "flight recorder: ranks 0, 2 wait in gloo:all_reduce #7 (process group default_pg)" in f.message
    assert "rank 1 never entered it (its last collective there: #6)" in f.message
    assert "no flight recorder answer from rank 3 (stopped, ended" in f.message
    assert (f.rank, f.node) == (1, "node-b")  # the one the others wait for
    # every rank outside communication; an answer to an earlier request does not count
    w = window(T0 + 30, train=ev, flights={0: flight(0, 6, 6, in_flight=False), 1: flight(1, 3, 3, request="q0")},
               rank_seen={0: T0 + 1}, flight_request="q1", attempt_t=T0)
    [f] = alerts.hang(w, HANG_10S)
    assert "flight recorder: rank 0 in no collective (stuck in computation" in f.message and "rank 1" not in f.message
    assert f.rank is None


def test_a_rank_outside_the_group_or_with_an_empty_recorder_is_not_blamed():
    ev = [train(s, 1.0, t=T0 + s) for s in range(1, 11)]
    answers = {0: flight(0, 7, 7, group="tp0"), 1: flight(1, 7, 7, group="tp0"),
               2: flight(2, 4, 4, group="tp1", groups=["tp1"]),  # another TP group: never in tp0
               3: flight(3, None, None, in_flight=False, entries=0, groups=[])}  # TORCH_FR_BUFFER_SIZE=0
    w = window(T0 + 30, train=ev, flights=answers, rank_seen={r: T0 for r in range(4)}, flight_request="q1")
    [f] = alerts.hang(w, HANG_10S)
    assert "never entered" not in f.message and f.rank is None
    assert "flight recorder empty on rank 3 (off with TORCH_FR_BUFFER_SIZE=0" in f.message
    # only empty answers: no verdict on where the ranks are
    w = window(T0 + 30, train=ev, flights={3: answers[3]}, rank_seen={3: T0}, flight_request="q1")
    [f] = alerts.hang(w, HANG_10S)
    assert "in no collective" not in f.message and "flight recorder empty on rank 3" in f.message


def test_a_rank_is_not_blamed_for_missing_a_point_to_point_op():
    ev = [train(s, 1.0, t=T0 + s) for s in range(1, 11)]
    answers = {1: {**flight(1, 5, 8, group="pp", collective="nccl:send 1->2"), "p2p": True},
               0: flight(0, 8, 8, in_flight=False, group="pp")}
    w = window(T0 + 30, train=ev, flights=answers, rank_seen={0: T0, 1: T0}, flight_request="q1")
    [f] = alerts.hang(w, HANG_10S)
    assert "rank 1 waits in nccl:send 1->2 #5" in f.message and "never entered" not in f.message and f.rank is None


def test_a_hang_before_the_first_step_is_one_alert_per_attempt():
    keys = {alerts.hang(window(t0 + CFG.startup_s + 5, started_t=t0), CFG)[0].key for t0 in (T0, T0 + 2000)}
    assert len(keys) == 2


def test_hang_names_the_collective_from_the_logs():
    w = window(T0 + 1000, train=[train(5, 1.0, t=T0 + 5)], last_collective="ALLREDUCE (timeout 600 s) on node a")
    [f] = alerts.hang(w, CFG)
    assert "ALLREDUCE" in f.message


def test_hang_quiet_while_stepping_slowly_or_loading_or_ended():
    # logged every 100 s: 5x the usual gap (500 s) is allowed before it counts as a hang
    slow = [train(s, 1.0, t=T0 + 100 * s) for s in range(1, 6)]
    assert alerts.hang(window(T0 + 500 + 400, train=slow), CFG) == []
    assert alerts.hang(window(T0 + 600), CFG) == []  # loading the model, under startup_s
    ev = [train(s, 1.0, t=T0 + s) for s in range(1, 11)]
    assert alerts.hang(window(T0 + 1000, running=False, train=ev), CFG) == []


def test_hang_before_the_first_step():
    [f] = alerts.hang(window(T0 + CFG.startup_s + 5), CFG)
    assert "no step logged yet" in f.message


# -- straggler -----------------------------------------------------------------------------------

def test_straggler_compares_time_outside_collectives_and_names_node_and_rank():
    # wall step times are equal (synchronous), but rank 2 is the one the others wait for
    tm = {0: [timing(0, 10, 2.0, cw=1.0)], 1: [timing(1, 10, 2.0, cw=1.05)],
          2: [timing(2, 10, 2.0, cw=0.0)], 3: [timing(3, 10, 2.0, cw=0.95)]}
    [f] = alerts.straggler(window(T0 + 20, timing=tm, placement={2: ("node-c", 1)}), CFG)
    assert f.rank == 2 and f.node == "node-c" and f.gpu == 1 and f.key == "straggler:2"
    assert "rank 2, node node-c, GPU 1" in f.message


def test_a_slow_pipeline_stage_is_named_by_its_compute_not_its_waits():
    """In a pipeline the waits are inside the schedule (the control all-reduce is short on every
    rank): the stage whose own compute is longest is the one named."""
    def stage(rank, compute):
        return {**timing(rank, 10, 2.0, cw=0.01), "pp_stages": [rank, rank + 4], "stage_compute_s": compute}

    tm = {0: [stage(0, 0.5)], 1: [stage(1, 0.52)], 2: [stage(2, 1.4)], 3: [stage(3, 0.55)]}
    [f] = alerts.straggler(window(T0 + 20, timing=tm, placement={2: ("node-a", 2)}), CFG)
    assert f.rank == 2 and f.message.startswith("slow pipeline stage: rank 2, node node-a, GPU 2 (stage 2, 6)")
    assert alerts.straggler(window(T0 + 20, timing={r: [stage(r, 0.5 + 0.01 * r)] for r in range(4)}), CFG) == []


def test_straggler_quiet_when_balanced_or_tiny_or_single_rank():
    even = {r: [timing(r, 10, 1.0, cw=0.2 + 0.02 * r)] for r in range(4)}
    assert alerts.straggler(window(T0 + 20, timing=even), CFG) == []
    tiny = {0: [timing(0, 10, 0.010)], 1: [timing(1, 10, 0.030)]}  # 3x but 20 ms: noise
    assert alerts.straggler(window(T0 + 20, timing=tiny), CFG) == []
    assert alerts.straggler(window(T0 + 20, timing={0: [timing(0, 10, 9.0)]}), CFG) == []


# -- GPU memory ----------------------------------------------------------------------------------

def test_gpu_memory_fires_above_95_percent():
    w = window(T0 + 5, mem={("a", 0): (T0 + 5, 78.0, 80.0), ("a", 1): (T0 + 5, 40.0, 80.0)})
    [f] = alerts.gpu_memory(w, CFG)
    assert (f.node, f.gpu) == ("a", 0) and "97.5%" in f.message


def test_gpu_memory_quiet_at_95_percent_or_unknown_total():
    w = window(T0 + 5, mem={("a", 0): (T0 + 5, 76.0, 80.0), ("a", 1): (T0 + 5, 1.0, 0.0)})
    assert alerts.gpu_memory(w, CFG) == []


# -- log lines -----------------------------------------------------------------------------------

def test_log_lines_are_classified_with_the_line():
    oom = alerts.log_line("node-a", "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
                          T0)
    assert oom.rule == "log" and oom.rank == 1 and oom.node == "node-a" and oom.severity == "error"
    assert oom.detail.startswith("[rank1]: torch.OutOfMemoryError") and "out of memory" in oom.message
    nccl = alerts.log_line("node-b", "[rank0]:[E ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective "
                           "operation timeout: WorkNCCL(SeqNum=42, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
                           "Timeout(ms)=600000) ran for 600093 milliseconds before timing out.", T0)
    assert nccl.key == "log:node-b:nccl_timeout:0" and "ALLREDUCE (timeout 600 s)" in nccl.message
    assert nccl.collective == "ALLREDUCE (timeout 600 s) on node node-b" and oom.collective is None
    exc = alerts.log_line("node-a", "[rank3]: ValueError: dataset row 17 has no 'messages'", T0)
    assert exc.rank == 3 and "Python exception in rank 3" in exc.message


def test_a_rank_that_stopped_for_another_ranks_error_raises_no_alert_of_its_own():
    """A bad record found by rank 1 gave two alerts: its data error and rank 0's "peer lost" with the
    same text and a hint about another node."""
    record = "/d/train.jsonl:2500: unknown record format with fields ['foo']"
    assert alerts.log_line("localhost", f"[rank0] error: PeerFailed: stopped: rank 1 found a bad record: {record}",
                           T0) is None
    found = alerts.log_line("localhost", f"[rank1] error: DataError: {record}", T0)
    assert found.rank == 1 and found.message.startswith(f"data error (node localhost, rank 1): {record}")


def test_ordinary_log_lines_stay_quiet():
    for line in ["[rank0]: step 10 loss 1.23", "WARNING: Setting OMP_NUM_THREADS environment variable",
                 "  File \"/x/train.py\", line 3, in main", ""]:
        assert alerts.log_line("a", line, T0) is None


def dpo_window(margins: list[float], chosen: list[float]) -> Window:
    return window(T0 + 60, train=[{**train(i + 1, 0.6), "rewards_margins": m, "rewards_accuracies": 0.0,
                                   "logps_chosen": c} for i, (m, c) in enumerate(zip(margins, chosen))])


def test_a_dpo_margin_stuck_at_zero_and_chosen_answers_pushed_down_are_named():
    steady = [-20.0] * 12
    [stuck] = alerts.preference_stalled(dpo_window([0.0] * 12, steady), CFG)
    assert "stayed within 0.01 of 0 for 10 logging windows up to step 12" in stuck.message
    assert alerts.preference_stalled(dpo_window([0.0] * 11 + [0.3], steady), CFG) == []  # it moved
    assert alerts.preference_stalled(dpo_window([0.0] * 10, steady), CFG) == []  # the first window is always 0
    learning = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1]
    [falling] = alerts.chosen_falling(dpo_window(learning, [-20.0 - 0.5 * i for i in range(12)]), CFG)
    assert "fell from -21 at step 3 to -25.5 at step 12" in falling.message and "rpo_alpha" in falling.message
    noisy = [-20.0, -20.5, -19.8, -20.4, -20.1, -19.9, -20.6, -20.0, -20.3, -19.7, -20.2, -20.1]
    assert alerts.chosen_falling(dpo_window(learning, noisy), CFG) == []
    assert alerts.preference_stalled(window(T0 + 60, train=[train(i + 1, 1.0) for i in range(12)]), CFG) == []


def test_evaluate_runs_every_rule_and_keys_are_stable():
    w = window(T0 + 90, util={("a", 0): util_series([5.0] * 91)}, mem={("a", 0): (T0 + 90, 79.9, 80.0)})
    first = alerts.evaluate(w, CFG)
    assert {f.rule for f in first} == {"low_utilisation", "gpu_memory"}
    assert [f.key for f in alerts.evaluate(w, CFG)] == [f.key for f in first]


# -- flight recorder -----------------------------------------------------------------------------

def test_flight_dump_names_rank_node_gpu_and_collective():
    rec = {"kind": "flight", "t": T0, "rank": 5, "file": "/tmp/nccl_trace_rank_5", "collective": "nccl:all_reduce",
           "seq": 41, "state": "started"}
    f = alerts.flight_dump(rec, "node-x", {5: ("node-b", 1)})
    assert (f.rule, f.key, f.node, f.rank, f.gpu) == ("collective_stuck", "flight:5:41", "node-b", 5, 1)
    assert f.message == "flight recorder of rank 5, node node-b, GPU 1: nccl:all_reduce #41 (started)"
    assert f.collective == "rank 5, node node-b, GPU 1: nccl:all_reduce #41 (started)"
    assert f.detail == "/tmp/nccl_trace_rank_5"
    # unknown placement: the delivering node
    assert alerts.flight_dump(rec, "node-x", {}).node == "node-x"
