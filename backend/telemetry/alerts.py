"""Alert rules: pure functions over a window of a run's recorded series.

Each rule takes a `Window` (what the ingestor has recorded recently for one run) and the
`AlertConfig`, and returns `Finding`s. A finding's `key` names the condition within the run;
the ingestor stores one row per key, so a rule that keeps firing on the same condition does not
flood the table. Log lines are classified with `backend.telemetry.logclass.classify_line`.
"""
from __future__ import annotations

import math
import re
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from backend.job.limits import hang_limit_s
from backend.telemetry import logclass


@dataclass(frozen=True)
class AlertConfig:
    low_util_pct: float = 60.0
    """GPU utilisation below this ..."""
    low_util_s: float = 60.0
    """... for longer than this (seconds) while the run is running."""
    wait_share: float = 0.25
    """Share of step time in collective (or data) wait that names the bottleneck."""
    spike_ratio: float = 2.0
    """A loss above this multiple of the median of the previous losses is a spike ..."""
    spike_sigmas: float = 4.0
    """... and also this many robust standard deviations above that median."""
    spike_history: int = 10
    """How many previous losses form the baseline (at least half of them must be present)."""
    hang_s: float = 300.0
    """No training step for this long (or `hang_multiple` x the usual time between logged steps, if longer)."""
    hang_multiple: float = 5.0
    startup_s: float = 900.0
    """Allowed time from the start event to the first logged step (model load, compile)."""
    straggler_ratio: float = 1.3
    """A rank whose step time (less collective wait) exceeds this multiple of the median."""
    straggler_min_s: float = 0.05
    """... by at least this many seconds (ignores noise on tiny steps)."""
    mem_pct: float = 95.0
    """GPU memory used above this share of the total."""
    expert_load_ratio: float = 3.0
    """A MoE expert taking more than this multiple of an even share (1 / experts) of the routed tokens ..."""
    expert_load_windows: int = 3
    """... in each of this many consecutive logging windows (one window's routing is noisy)."""
    preference_windows: int = 10
    """Preference training: logging windows (after the first) whose reward margin stays within
    `preference_margin` of 0 (no preference learned: a reference that moves with the policy, a learning
    rate of 0), or over which the chosen answers' log-prob falls ..."""
    preference_margin: float = 0.01
    chosen_drop: float = 0.1
    """... by more than this share of its first value (and 2 nats): both answers pushed down."""


@dataclass(frozen=True)
class Finding:
    rule: str
    key: str
    severity: str  # "warning" | "error"
    t: float
    message: str
    node: str | None = None
    rank: int | None = None
    gpu: int | None = None
    detail: str | None = None
    collective: str | None = None
    """The collective this finding reports stuck, with where it ran (what `hang` then names)."""


@dataclass
class Window:
    """The recent record of one run, as the rules see it.

    util:  (node, gpu) -> [(t, util_pct)] in time order
    mem:   (node, gpu) -> (t, mem_used_gib, mem_total_gib), the latest sample
    train: rank 0's `train` events in step order (dicts with step, time, loss, grad_norm, ...)
    timing: rank -> that rank's `timing` events in step order
    placement: rank -> (node, gpu or None)
    """

    now: float
    running: bool
    started_t: float | None = None
    util: dict[tuple[str, int], list[tuple[float, float]]] = field(default_factory=dict)
    mem: dict[tuple[str, int], tuple[float, float, float]] = field(default_factory=dict)
    train: list[dict[str, Any]] = field(default_factory=list)
    timing: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    placement: dict[int, tuple[str, int | None]] = field(default_factory=dict)
    checkpoint: tuple[int, str] | None = None
    """(step, path) of the last checkpoint event."""
    evaluated: tuple[float, int] | None = None
    """(t, step) of the last `eval` or `eval_progress` event: an evaluation reports while it runs, and is progress."""
    last_collective: str | None = None
    """The collective last reported stuck: by a NCCL watchdog line in a log, or a flight recorder dump."""
    rank_states: dict[int, tuple[str, float]] = field(default_factory=dict)
    """rank -> (its process's state as its node's agent last reported it, since when)."""
    flights: dict[int, dict[str, Any]] = field(default_factory=dict)
    """rank -> its last answer to a flight recorder request (an agent `flight` line)."""
    rank_seen: dict[int, float] = field(default_factory=dict)
    """rank -> when its node's agent last reported its process (the ranks of this attempt: since its start)."""
    flight_request: str | None = None
    """The watch's latest flight recorder request: the answers read are those to it."""
    attempt_t: float | None = None
    """When the watched attempt started (its ranks' processes may be reported before its `start` event)."""


def _where(rank: int, node: str | None, gpu: int | None) -> str:
    parts = [f"rank {rank}"]
    if node is not None:
        parts.append(f"node {node}")
    if gpu is not None:
        parts.append(f"GPU {gpu}")
    return ", ".join(parts)


def number(x: Any) -> float | None:
    """x as a float (NaN and inf included) when it is a JSON number, else None."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _wait_shares(w: Window, since: float) -> tuple[float, float] | None:
    """Mean share of step time spent in collective wait and in data wait, over all ranks' timing
    events newer than `since` (the last event of each rank when none is that recent)."""
    cw = dw = st = 0.0
    for events in w.timing.values():
        recent = [e for e in events if (number(e.get("time")) or 0) >= since] or events[-1:]
        for e in recent:
            step_t = number(e.get("step_time_s"))
            if not step_t or step_t <= 0:
                continue
            st += step_t
            cw += number(e.get("collective_wait_s")) or 0.0
            dw += number(e.get("data_wait_s")) or 0.0
    return (cw / st, dw / st) if st > 0 else None


def low_utilisation(w: Window, cfg: AlertConfig) -> list[Finding]:
    if not w.running:
        return []
    low = []
    for (node, gpu), pts in sorted(w.util.items()):
        recent = [u for t, u in pts if t >= w.now - cfg.low_util_s]
        before = [(t, u) for t, u in pts if t < w.now - cfg.low_util_s]
        # low for the whole window: the last sample before it (taken after the start) and every
        # sample inside it
        if not recent or not before or w.started_t is None or before[-1][0] < w.started_t:
            continue
        if before[-1][1] < cfg.low_util_pct and all(u < cfg.low_util_pct for u in recent):
            low.append((node, gpu, statistics.fmean(recent)))
    if not low:
        return []
    shares = _wait_shares(w, w.now - cfg.low_util_s)
    if shares is None:
        why = "no timing events from the workers to tell communication from input"
    else:
        cw, dw = shares
        if cw >= cfg.wait_share and cw >= dw:
            why = f"communication-bound: {cw:.0%} of step time waiting in collectives (data wait {dw:.0%})"
        elif dw >= cfg.wait_share:
            why = f"input-bound: {dw:.0%} of step time waiting for data (collective wait {cw:.0%})"
        else:
            why = (f"neither collectives ({cw:.0%}) nor data loading ({dw:.0%}) explain it: "
                   "small batch or CPU-side work per step")
    gpus = ", ".join(f"{n}:{g} ({u:.0f}%)" for n, g, u in low[:16]) + (" …" if len(low) > 16 else "")
    one = low[0] if len(low) == 1 else None
    return [Finding(
        "low_utilisation", "low_utilisation", "warning", w.now,
        f"GPU utilisation below {cfg.low_util_pct:.0f}% for over {cfg.low_util_s:.0f} s on {len(low)} GPU(s) "
        f"[{gpus}]; {why}",
        node=one[0] if one else None, gpu=one[1] if one else None)]


def non_finite(w: Window, cfg: AlertConfig) -> list[Finding]:
    out = []
    for name in ("loss", "grad_norm"):
        for e in w.train:
            # The worker writes JSON without NaN/inf: the value is null and `nonfinite` says what it was.
            v = (e.get("nonfinite") or {}).get(name)
            if v is not None:
                ck = (f"last checkpoint: step {w.checkpoint[0]} ({w.checkpoint[1]})" if w.checkpoint
                      else "no checkpoint yet")
                out.append(Finding(
                    "non_finite", f"non_finite:{name}", "error", number(e.get("time")) or w.now,
                    f"{name} is {v} at step {e.get('step')}; stop the run and lower the learning rate or "
                    f"check the data and dtype (fp16 overflow); {ck}", rank=0))
                break
    return out


def loss_spike(w: Window, cfg: AlertConfig) -> list[Finding]:
    out = []
    losses = [(e.get("step"), number(e.get("loss")), number(e.get("time"))) for e in w.train]
    losses = [(s, v, t) for s, v, t in losses if v is not None and math.isfinite(v)]
    need = max(3, cfg.spike_history // 2)
    for i in range(need, len(losses)):
        step, v, t = losses[i]
        base = [x for _, x, _ in losses[max(0, i - cfg.spike_history):i]]
        med = statistics.median(base)
        sigma = 1.4826 * statistics.median(abs(x - med) for x in base)
        if med > 0 and v > cfg.spike_ratio * med and v - med > cfg.spike_sigmas * sigma:
            out.append(Finding(
                "loss_spike", f"loss_spike:{step}", "warning", t or w.now,
                f"loss spiked to {v:.4g} at step {step} ({v / med:.1f}x the median {med:.4g} of the previous "
                f"{len(base)} logged steps)", rank=0))
    return out


def hang(w: Window, cfg: AlertConfig) -> list[Finding]:
    if not w.running or w.started_t is None:
        return []
    progress = [(number(e.get("time")), e.get("step")) for e in w.train]
    for events in w.timing.values():
        progress += [(number(e.get("time")), e.get("step")) for e in events]
    if w.evaluated is not None:
        progress.append(w.evaluated)
    progress = [(t, s) for t, s in progress if t is not None and t >= w.started_t]
    if progress:
        last_t, last_step = max(progress, key=lambda p: p[0])
        times = sorted(number(e.get("time")) for e in w.train if number(e.get("time")) is not None)
        gaps = [b - a for a, b in zip(times, times[1:]) if b > a]
        limit = hang_limit_s(cfg.hang_s, cfg.hang_multiple, gaps)
    else:
        last_t, last_step, limit = w.started_t, None, cfg.startup_s
    idle = w.now - last_t
    if idle <= limit:
        return []
    what = f"no training step for {idle:.0f} s" + (f" (last logged step {last_step})" if last_step is not None
                                                 else " since the start (no step logged yet)")
    stuck = _stuck_rank(w)
    halted = _halted_ranks(w, idle)
    halted_ranks = {r for r, _, _ in halted}
    if stuck and len(halted) > 1 and stuck[0] in halted_ranks:
        # ranks stopped together stop a step apart wherever each was: the one behind is the cause
        # only as one of a single node's ranks halted while others are not (its filesystem);
        # every rank halted (a job-wide SIGSTOP), or ranks on several nodes, names no one
        nodes = {w.placement.get(r, (None, None))[0] for r in halted_ranks}
        if len(nodes) > 1 or None in nodes or halted_ranks >= set(w.timing) | set(w.rank_states):
            stuck = None
    flight, never_entered = _flight_diagnosis(w)
    rank = (stuck[0] if stuck else halted[0][0] if len(halted) == 1
            else never_entered[0] if len(never_entered) == 1 else None)
    node, gpu = w.placement.get(rank, (None, None)) if rank is not None else (None, None)
    blamed = f"{_where(rank, node, gpu)} last reported step {stuck[1]} while other ranks reached {stuck[2]}" if stuck else ""
    others = []
    for r, state, held in halted[:4]:
        if r == rank:
            held_s = f"has been {HALTED[state]} for {held:.0f} s: the other ranks wait for it"
            blamed = f"{blamed} and {held_s}" if blamed else f"{_where(r, node, gpu)} {held_s}"
        else:
            others.append(f"{_where(r, *w.placement.get(r, (None, None)))} has been {HALTED[state]} for {held:.0f} s")
    if stuck and not any(r == rank for r, _, _ in halted):
        blamed += ": likely stuck"
    if len(halted) > 4:
        others.append(f"{len(halted) - 4} more ranks halted")
    what += "".join(f"; {clause}" for clause in ([blamed] if blamed else []) + others)
    if flight:
        what += f"; {flight}"
    elif w.last_collective:
        what += f"; last collective reported stuck: {w.last_collective}"
    # before the first step, one hang per attempt (its start), not one for every attempt
    key = f"hang:{last_step}" if last_step is not None else f"hang:start@{w.started_t:.0f}"
    return [Finding("hang", key, "error", w.now, what, node=node, rank=rank, gpu=gpu)]


def _flight_diagnosis(w: Window) -> tuple[str, list[int]]:
    """What the ranks' answers to the watch's latest flight recorder request say: the collective
    the most ranks wait in, the answering ranks of its group that never entered it (returned too:
    the ranks the others wait for), the ranks whose recorder was empty or unreadable, and the
    ranks that did not answer."""
    if w.flight_request is None:
        return "", []
    answers = {r: rec for r, rec in w.flights.items() if rec.get("request") == w.flight_request}
    if not answers:
        return "", []
    usable = {r: rec for r, rec in answers.items() if rec.get("entries")}
    waiting = {r: rec for r, rec in usable.items() if rec.get("in_flight")}
    parts, behind = [], []
    if waiting:
        counts = Counter((rec.get("group"), rec.get("seq"), rec.get("collective")) for rec in waiting.values())
        group, seq, collective = max(counts, key=lambda k: (counts[k], -(k[1] if isinstance(k[1], int) else 0)))
        inside = sorted(r for r, rec in waiting.items() if (rec.get("group"), rec.get("seq")) == (group, seq))
        first = waiting[inside[0]]
        parts.append(f"flight recorder: {_ranks(inside)} wait{'s' if len(inside) == 1 else ''} in "
                     f"{collective or 'a collective'} #{seq} (process group {_pg_label(first)})")
        if isinstance(seq, int) and not first.get("p2p"):
            # a rank outside the group has no entries of it: only members can be behind
            behind = sorted(r for r, rec in usable.items() if r not in inside
                            and (group in (rec.get("groups") or ()) or group in (rec.get("last_seq") or {}))
                            and (rec.get("last_seq") or {}).get(group, -1) < seq)
        if behind:
            last = (usable[behind[0]].get("last_seq") or {}).get(group)
            parts.append(f"{_ranks(behind)} never entered it"
                         + (f" (its last collective there: #{last})" if len(behind) == 1 and last is not None else ""))
    elif usable:
        parts.append(f"flight recorder: {_ranks(sorted(usable))} in no collective (stuck in computation, data "
                     "loading or I/O)")
    empty = sorted(set(answers) - set(usable))
    if empty:
        parts.append(f"flight recorder empty on {_ranks(empty)} (off with TORCH_FR_BUFFER_SIZE=0, or unreadable)")
    since = w.attempt_t or w.started_t or 0.0
    silent = sorted(r for r, seen in w.rank_seen.items() if seen >= since and r not in answers)
    if silent:
        parts.append(f"no flight recorder answer from {_ranks(silent)} (stopped, ended, or blocked where Python "
                     "cannot run)")
    errors = sorted({str(rec["error"]) for rec in answers.values() if rec.get("error")})
    if errors:
        parts.append(f"flight recorder errors: {'; '.join(errors)[:300]}")
    return "; ".join(parts), behind


def _pg_label(rec: dict[str, Any]) -> str:
    """A process group as people know it: its description (default_pg) where it has one."""
    pg = rec.get("process_group")
    if isinstance(pg, (list, tuple)) and pg:
        return str(pg[1]) if len(pg) > 1 and pg[1] not in (None, "", "undefined") else str(pg[0])
    return str(pg)


def _ranks(ranks: list[int]) -> str:
    return (f"rank {ranks[0]}" if len(ranks) == 1 else
            "ranks " + ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else ""))


HALTED = {"stopped": "stopped (SIGSTOP, a debugger or job control)",
          "disk_sleep": "blocked in uninterruptible I/O (D state: a hung filesystem such as NFS, or a device)"}


def _halted_ranks(w: Window, idle: float) -> list[tuple[int, str, float]]:
    """(rank, state, seconds held) of the ranks whose process its agent has seen stopped or in
    uninterruptible I/O during this attempt, for at least half the time without a step (a brief
    D state is an ordinary file read)."""
    found = []
    for rank, (state, since) in sorted(w.rank_states.items()):
        held = w.now - since
        if state in HALTED and since >= (w.attempt_t or w.started_t or 0.0) and held >= idle / 2:
            found.append((rank, state, held))
    return found


def _stuck_rank(w: Window) -> tuple[int, Any, Any] | None:
    last = {r: ev[-1].get("step") for r, ev in w.timing.items() if ev and isinstance(ev[-1].get("step"), int)}
    if len(last) < 2:
        return None
    lo = min(last.values())
    hi = max(last.values())
    behind = [r for r, s in last.items() if s == lo]
    if lo == hi or len(behind) != 1:
        return None
    return behind[0], lo, hi


def straggler(w: Window, cfg: AlertConfig) -> list[Finding]:
    """In synchronous training every rank's wall step time is the same (the fast ones wait for the
    slow one in the collectives), so ranks are compared on step time less collective wait; in a
    pipeline, where the waits are inside the schedule, on each stage's own compute."""
    busy: dict[int, float] = {}
    stages: dict[int, list] = {}
    for rank, events in w.timing.items():
        vals = []
        for e in events[-3:]:
            if "stage_compute_s" in e:
                vals.append(number(e.get("stage_compute_s")))
                stages[rank] = e.get("pp_stages")
                continue
            st = number(e.get("step_time_s"))
            if st is not None:
                vals.append(st - (number(e.get("collective_wait_s")) or 0.0))
        vals = [v for v in vals if v is not None]
        if vals:
            busy[rank] = statistics.fmean(vals)
    if len(busy) < 2:
        return []
    med = statistics.median(busy.values())
    out = []
    for rank, b in sorted(busy.items()):
        if med > 0 and b > cfg.straggler_ratio * med and b - med >= cfg.straggler_min_s:
            node, gpu = w.placement.get(rank, (None, None))
            if rank in stages:
                message = (f"slow pipeline stage: {_where(rank, node, gpu)} (stage {_stage_list(stages[rank])}) "
                           f"computes {b:.3g} s per step, {b / med:.2f}x the median {med:.3g} s of {len(busy)} "
                           "ranks; the pipeline runs at its pace (more layers or the output layer on it, "
                           "thermal throttling, another process on the GPU)")
            else:
                message = (f"straggler: {_where(rank, node, gpu)} takes {b:.3g} s per step outside collectives, "
                           f"{b / med:.2f}x the median {med:.3g} s of {len(busy)} ranks "
                           "(thermal throttling, another process on the GPU, or a slow NIC)")
            out.append(Finding("straggler", f"straggler:{rank}", "warning", w.now, message,
                               node=node, rank=rank, gpu=gpu))
    return out


def _stage_list(stages) -> str:
    return ", ".join(str(s) for s in stages) if isinstance(stages, list) else "?"


def gpu_memory(w: Window, cfg: AlertConfig) -> list[Finding]:
    out = []
    for (node, gpu), (t, used, total) in sorted(w.mem.items()):
        if total and total > 0 and used / total * 100 > cfg.mem_pct:
            out.append(Finding(
                "gpu_memory", f"gpu_memory:{node}:{gpu}", "warning", t,
                f"GPU memory at {used / total:.1%} ({used:.1f} of {total:.1f} GiB) on node {node} GPU {gpu}: "
                "close to out of memory",
                node=node, gpu=gpu))
    return out


def expert_imbalance(w: Window, cfg: AlertConfig) -> list[Finding]:
    """One expert taking most of the tokens: the router has collapsed onto it (the others starve and
    the rank holding it sets every step's pace under expert parallel)."""
    recent = [e for e in w.train if isinstance(e.get("moe_expert_tokens"), list)][-cfg.expert_load_windows:]
    if len(recent) < cfg.expert_load_windows:
        return []
    shares = []
    for e in recent:
        counts = [number(c) or 0.0 for c in e["moe_expert_tokens"]]
        total = sum(counts)
        if not counts or total <= 0:
            return []
        top = max(range(len(counts)), key=counts.__getitem__)
        shares.append((top, counts[top] / total, len(counts)))
    experts = shares[-1][2]
    even = 1 / experts
    if len({top for top, _, _ in shares}) != 1 or min(share for _, share, _ in shares) <= cfg.expert_load_ratio * even:
        return []
    top, share, _ = shares[-1]
    last = recent[-1]
    return [Finding("expert_imbalance", f"expert_imbalance:{top}", "warning", number(last.get("time")) or w.now,
                    f"expert {top} took {share:.0%} of the routed tokens (an even share is {even:.0%} of {experts} "
                    f"experts) for {len(recent)} logging windows up to step {last.get('step')}: the router is "
                    "collapsing onto it; raise router_aux_loss_coef (the load-balancing loss) or lower the learning "
                    "rate")]


def preference_stalled(w: Window, cfg: AlertConfig) -> list[Finding]:
    """DPO whose reward margin stays at 0: the policy is not moving away from its reference."""
    recent = [e for e in w.train if number(e.get("rewards_margins")) is not None and (number(e.get("step")) or 0) > 1]
    recent = recent[-cfg.preference_windows:]
    if len(recent) < cfg.preference_windows or any(abs(number(e["rewards_margins"])) > cfg.preference_margin
                                                   for e in recent):
        return []
    last = recent[-1]
    return [Finding("preference_stalled", "preference_stalled", "warning", number(last.get("time")) or w.now,
                    f"the reward margin stayed within {cfg.preference_margin:g} of 0 for {len(recent)} logging windows "
                    f"up to step {last.get('step')} (accuracy {number(last.get('rewards_accuracies')) or 0:.0%}): the "
                    "policy is not moving from its reference; check the learning rate, and that chosen and rejected "
                    "answers differ in the data")]


def chosen_falling(w: Window, cfg: AlertConfig) -> list[Finding]:
    """DPO pushing the chosen answers' likelihood down with the rejected ones' (margin up, both down)."""
    values = [(e.get("step"), number(e.get("logps_chosen")), number(e.get("time"))) for e in w.train]
    values = [(s, v, t) for s, v, t in values if v is not None and math.isfinite(v)][-cfg.preference_windows:]
    if len(values) < cfg.preference_windows:
        return []
    (first_step, first, _), (step, last, t) = values[0], values[-1]
    falling = sum(b[1] < a[1] for a, b in zip(values, values[1:])) >= 0.7 * (len(values) - 1)
    if not (falling and first - last > max(2.0, cfg.chosen_drop * abs(first))):
        return []
    return [Finding("chosen_falling", "chosen_falling", "warning", t or w.now,
                    f"the chosen answers' log-prob fell from {first:.4g} at step {first_step} to {last:.4g} at step "
                    f"{step}: DPO is pushing both answers down (the margin can grow while both fall); add rpo_alpha "
                    "(an NLL term on the chosen answers), raise beta or lower the learning rate")]


RULES = (low_utilisation, non_finite, loss_spike, hang, straggler, gpu_memory, expert_imbalance, preference_stalled,
         chosen_falling)


def evaluate(w: Window, cfg: AlertConfig = AlertConfig()) -> list[Finding]:
    """Every rule's findings for one run's window."""
    return [f for rule in RULES for f in rule(w, cfg)]


def flight_dump(rec: dict[str, Any], node: str, placement: dict[int, tuple[str, int | None]]) -> Finding:
    """A finding for an agent `flight` line: the collective a rank was in when PyTorch's flight
    recorder dumped (on a collective timeout)."""
    rank = int(rec["rank"])
    where_node, gpu = placement.get(rank, (node, None))
    what = f"{rec.get('collective') or 'unknown collective'} #{rec.get('seq')} ({rec.get('state') or 'unknown state'})"
    collective = f"{_where(rank, where_node, gpu)}: {what}"
    return Finding("collective_stuck", f"flight:{rank}:{rec.get('seq')}", "error", number(rec.get("t")) or 0.0,
                   f"flight recorder of {collective}", node=where_node, rank=rank, gpu=gpu,
                   detail=str(rec.get("file")), collective=collective)


_OP = re.compile(r"OpType=(\w+)")
_TIMEOUT_MS = re.compile(r"Timeout\(ms\)=(\d+)")


def collective_of(line: str) -> str | None:
    """The collective and timeout named by a NCCL watchdog line
    (`WorkNCCL(SeqNum=12, OpType=ALLREDUCE, ..., Timeout(ms)=600000)`), if it names one."""
    m = _OP.search(line)
    if not m:
        return None
    t = _TIMEOUT_MS.search(line)
    return m.group(1) + (f" (timeout {int(t.group(1)) / 1000:.0f} s)" if t else "")


def log_line(node: str, line: str, t: float) -> Finding | None:
    """A finding for a node's torchrun log line that names a failure (OOM, NCCL timeout, Python
    exception in rank N, ...), with the line itself as detail; None for an ordinary line."""
    cause = logclass.classify_line(line)
    if cause is None or logclass.follows_another_rank(line):  # the rank that failed first has the alert
        return None
    message = logclass.describe(cause, node=node)
    op = collective_of(line) if cause.kind == logclass.NCCL_TIMEOUT else None
    if op:
        message += f" [collective: {op}]"
    hint = logclass.HELP.get(cause.kind)
    if hint:
        message += f" ({hint})"
    severity = "warning" if cause.kind == logclass.PEER_LOST else "error"
    rank = "" if cause.rank is None else cause.rank
    return Finding("log", f"log:{node}:{cause.kind}:{rank}", severity, t, message,
                   node=node, rank=cause.rank, detail=line.strip()[:2000],
                   collective=f"{op} on node {node}" if op else None)
