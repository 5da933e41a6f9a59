"""Ingest of node-agent lines: batched writes, exactly-once events, a live tail for charts,
downsampling, and the alert rules.

One `Ingestor` per database, shared by every run and node. The cluster backend calls
`feed(run_id, node, line, attempt)` for each stdout line of a node's agent of the run's attempt
(from its asyncio loop: `feed` only parses and buffers, never touches the database) and starts a
reconnecting agent with `--offsets json.dumps(ingestor.offsets(run_id, node))`. A background thread (`start()`) writes
the buffers every `flush_interval_s`, evaluates the alert rules and downsamples old samples.

Exactly once: an event line is identified by (run, file, byte offset after the line). The
ingestor drops any line at or below the highest offset it has taken for that file, and commits
the event rows, the series derived from them and the new offsets in one transaction;
`offsets()` flushes first, so what it returns is both committed and complete.
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any, Iterable, Protocol

from sqlalchemy import case, delete, func, insert, literal, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.engine import Engine

from backend.telemetry import query
from backend.telemetry import alerts as rules
from backend.telemetry.query import SeriesKey, SeriesResult
from backend.store.telemetry_models import (NO_INDEX, Alert, IngestOffset, MetricSample, RankPlacement, RunEvent,
                                      create_telemetry_tables)

log = logging.getLogger(__name__)

S, E, A, O, P = (m.__table__ for m in (MetricSample, RunEvent, Alert, IngestOffset, RankPlacement))

# Fields of agent lines that are not metrics.
_NOT_METRIC = {"kind", "t", "gpu", "run_pids"}
TRAIN_FIELDS = ("loss", "grad_norm", "learning_rate", "tokens", "tokens_per_s", "samples_per_s", "step_time_s",
                "mfu", "mem_allocated_gib", "mem_peak_gib", "epoch", "eta_s", "moe_aux_loss", "moe_max_expert_share",
                "rewards_chosen", "rewards_rejected", "rewards_margins", "rewards_accuracies", "logps_chosen",
                "logps_rejected")
EXPERT_TOKENS = "train/moe_expert_tokens"
"""Routed tokens per expert of a MoE model in each logging window: one series per expert, the
expert's index in the series' `gpu` column (the index the charts split series by)."""
TIMING_FIELDS = ("step_time_s", "collective_wait_s", "data_wait_s", "stage_compute_s", "mem_peak_gib")
EVAL_FIELDS = ("eval_loss",)
AGENT_SILENT_S = 30.0  # an agent not heard from for this long is taken as gone (it samples every second)
SAMPLE_COLUMNS = ("run_id", "node", "gpu", "rank", "name", "t", "value", "step", "res_s", "attempt")
# Series that are sampled on a clock (and so are downsampled); train/ and rank/ follow steps.
SAMPLED_PREFIXES = ("gpu/", "host/")


@dataclass(frozen=True)
class Downsampling:
    """Full resolution for `raw_s`, then `mid_bucket_s` means until `old_after_s`, then
    `old_bucket_s` means. Applies to clock-sampled series (gpu/, host/)."""

    raw_s: float = 3600.0
    mid_bucket_s: float = 60.0
    old_after_s: float = 86400.0
    old_bucket_s: float = 600.0


@dataclass
class _RunState:
    """What the alert rules and the live tail need of one run, kept in memory."""

    high: dict[str, int] = field(default_factory=dict)  # file -> highest offset taken
    tail: deque = field(default_factory=deque)  # (seq, SeriesKey, t, value)
    evicted_seq: int = 0
    # The cursor of the latest `start` event: a reader from before it may hold steps a resumed
    # attempt does again, so it redraws from the history (which shows each step once).
    start_seq: int = 0
    running: bool = False
    started_t: float | None = None
    util: dict[tuple[str, int], deque] = field(default_factory=dict)
    mem: dict[tuple[str, int], tuple[float, float, float]] = field(default_factory=dict)
    train: deque = field(default_factory=lambda: deque(maxlen=64))
    timing: dict[int, deque] = field(default_factory=dict)
    placement: dict[int, tuple[str, int | None]] = field(default_factory=dict)
    checkpoint: tuple[int, str] | None = None
    evaluated: tuple[float, int] | None = None  # (t, step) of the latest eval(_progress) event: evaluating is no hang
    last_collective: str | None = None
    rank_states: dict[int, tuple[str, float]] = field(default_factory=dict)  # rank -> (state, since t)
    flights: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> its last requested flight line
    # rank -> when an agent last named it in a `rank_state` line (each new agent names all its ranks)
    rank_seen: dict[int, float] = field(default_factory=dict)
    flight_request: str | None = None  # the watch's latest flight recorder request
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)  # node -> agent status
    dirty: bool = False
    last_compact: float = 0.0
    keys: dict[tuple, SeriesKey] = field(default_factory=dict)

    def key(self, name: str, node: str, gpu: int, rank: int) -> SeriesKey:
        """One shared SeriesKey per series: the tail holds hundreds of thousands of points."""
        k = (name, node, gpu, rank)
        found = self.keys.get(k)
        if found is None:
            found = self.keys[k] = SeriesKey(*k)
        return found


@dataclass
class _Pending:
    samples: list[tuple] = field(default_factory=list)  # in SAMPLE_COLUMNS order
    events: list[tuple[dict, list[tuple]]] = field(default_factory=list)  # (event row, its series rows)
    offsets: dict[tuple[str, str], tuple[int, str]] = field(default_factory=dict)
    placements: dict[tuple[str, int], dict] = field(default_factory=dict)
    findings: list[tuple[str, rules.Finding]] = field(default_factory=list)
    # findings that replace the stored alert of their key (a watch's final diagnosis)
    diagnoses: list[tuple[str, rules.Finding]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.samples or self.events or self.offsets or self.placements or self.findings
                    or self.diagnoses)


def log_key(file: str, attempt: int | None) -> str:
    """Where a node log's committed offset is kept: per attempt, since each launch writes it anew."""
    return file if attempt is None else f"{file}#attempt-{int(attempt)}"


def _value(x: Any) -> float | None:
    """A point's value, the same in the live tail and the database: NaN/inf and non-numbers
    become None."""
    v = rules.number(x)
    return v if v is not None and math.isfinite(v) else None


class TelemetrySink(Protocol):
    """What the control plane asks of the telemetry it feeds and reads (the Ingestor): a run's
    watch feeds agent lines, the manager facade reads series, alerts and events."""

    def offsets(self, run_id: str, node: str, attempt: int | None = None) -> dict[str, int]: ...

    def read_offsets(self, run_id: str, prefix: str) -> dict[str, int]: ...

    def on_agent_line(self, run_id: str, node: str, rec: Any, attempt: int | None = None,
                      read: tuple[str, int] | None = None) -> None: ...

    def flush(self) -> int: ...

    def series(self, run_id: str, names: Iterable[str], since: int | None = None,
               max_points: int = 1000) -> SeriesResult: ...

    def alerts(self, run_id: str) -> list[Alert]: ...

    def events(self, run_id: str, etypes: Iterable[str], limit: int | None = None) -> dict[str, list[dict]]: ...

    def watch_attempt(self, run_id: str, started_at: float, hang_s: float, multiple: float) -> None: ...

    def hang(self, run_id: str, since: float, now: float | None = None) -> rules.Finding | None: ...

    def awaiting_flight(self, run_id: str, request: str) -> bool: ...

    def stopping_hung(self, run_id: str, attempt: int, finding: rules.Finding) -> None: ...

    def close(self) -> None: ...


class Ingestor:
    def __init__(self, engine: Engine, *, flush_interval_s: float = 0.25, tail_s: float = 60.0,
                 tail_max_points: int = 200_000, eval_interval_s: float = 2.0, compact_interval_s: float = 300.0,
                 alert_config: rules.AlertConfig = rules.AlertConfig(),
                 downsampling: Downsampling = Downsampling(), clock=time.time, autostart: bool = True):
        self.engine, self.autostart = engine, autostart
        self.flush_interval_s, self.tail_s, self.tail_max_points = flush_interval_s, tail_s, tail_max_points
        self.eval_interval_s, self.compact_interval_s = eval_interval_s, compact_interval_s
        self.alert_config, self.downsampling, self.clock = alert_config, downsampling, clock
        create_telemetry_tables(engine)
        self._lock = threading.Lock()  # runs, pending, seq
        self._flush_lock = threading.Lock()  # one writer at a time
        self._runs: dict[str, _RunState] = {}
        self._alert_configs: dict[str, rules.AlertConfig] = {}  # runs with a hang limit of their own
        self._attempt_started: dict[str, float] = {}  # run id -> when the watched attempt started
        self._hung_attempt: dict[str, int] = {}  # run id -> the attempt a watch is stopping as hung
        self._pending = _Pending()
        # Cursors start at this process's start time in microseconds, so a cursor kept by a
        # browser across a backend restart is always recognised as foreign.
        self._seq0 = self._seq = time.time_ns() // 1000
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.stats = {"lines": 0, "bad_lines": 0, "duplicates": 0, "samples": 0, "events": 0, "flushes": 0,
                      "flush_errors": 0}
        self.latencies: deque[float] = deque(maxlen=200_000)  # commit time - sample time, seconds

    # ------------------------------------------------------------------------------- input
    def feed(self, run_id: str, node: str, line: str | bytes, attempt: int | None = None) -> None:
        """Take one agent stdout line of the run's `attempt`. Never raises for bad input: it is
        counted and logged."""
        try:
            rec = json.loads(line)
        except (ValueError, TypeError):
            self.stats["bad_lines"] += 1
            log.warning("agent %s/%s: unreadable line %.200r", run_id, node, line)
            return
        self.on_agent_line(run_id, node, rec, attempt)

    def on_agent_line(self, run_id: str, node: str, rec: Any, attempt: int | None = None,
                      read: tuple[str, int] | None = None) -> None:
        """Take one parsed agent line (the cluster backend's `TelemetrySink` call), from an agent
        of the run's `attempt` (its rows carry it). Only parses and buffers; the database is
        written by the background thread, started on the first line unless `autostart=False`.

        `read`: (file under the run directory, byte offset after the line) where the line was read
        from an agent's file rather than its stream (a Slurm job's agents). Its offset is committed
        with the line's rows, and a line at or below the committed offset of its file is dropped:
        a watch that starts again (a re-attach, a second studio) stores no sample twice."""
        if self.autostart and self._thread is None:
            self.start()
        kind = rec.get("kind") if isinstance(rec, dict) else None
        with self._lock:
            self.stats["lines"] += 1
            if read is not None and not self._take_offset(run_id, node, self._run(run_id),
                                                          {"file": read[0], "offset": read[1]}):
                return
            if kind not in _HANDLERS:  # not an agent line, or a kind this backend does not know yet
                self.stats["bad_lines"] += 1
                return
            try:
                st = self._run(run_id)
                handler = Ingestor._on_read_log if kind == "log" and read is not None else _HANDLERS[kind]
                if handler is not None:
                    handler(self, run_id, node, st, rec, attempt)
                st.nodes.setdefault(node, {})["last_seen"] = self.clock()
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                self.stats["bad_lines"] += 1
                log.warning("agent %s/%s: malformed line (%s): %.200r", run_id, node, exc, rec)

    def _run(self, run_id: str) -> _RunState:
        st = self._runs.get(run_id)
        if st is None:
            st = self._runs[run_id] = self._load_run(run_id)
        return st

    def _load_run(self, run_id: str) -> _RunState:
        """Resume a run's state from the database (after a backend restart)."""
        st = _RunState()
        with self.engine.connect() as conn:
            st.high = {f: o for f, o in conn.execute(select(O.c.file, O.c.offset).where(O.c.run_id == run_id))}
            st.placement = {r: (n, g) for r, n, g in conn.execute(
                select(P.c.rank, P.c.node, P.c.gpu).where(P.c.run_id == run_id))}
            rows = conn.execute(select(E.c.type, E.c.rank, E.c.data).where(
                E.c.run_id == run_id, E.c.type.in_(("start", "end", "train", "timing", "checkpoint", "eval", "eval_progress")))
                .order_by(E.c.id.desc()).limit(500)).all()
        for etype, rank, data in reversed(rows):
            self._track_event(st, etype, rank, json.loads(data))
        return st

    def _add_point(self, run_id: str, st: _RunState, key: SeriesKey, t: float, value: Any, attempt: int | None,
                   step: int | None = None, into: list[tuple] | None = None) -> None:
        self._seq += 1
        v = _value(value)
        st.tail.append((self._seq, key, t, v))
        row = (run_id, key.node, key.gpu, key.rank, key.name, t, v, step, 0.0, attempt)
        (self._pending.samples if into is None else into).append(row)
        self.stats["samples"] += 1

    def _on_gpu(self, run_id: str, node: str, st: _RunState, rec: dict, attempt: int | None) -> None:
        t, gpu = float(rec["t"]), int(rec["gpu"])
        for name, value in rec.items():
            if name not in _NOT_METRIC and rules.number(value) is not None:
                self._add_point(run_id, st, st.key(f"gpu/{name}", node, gpu, NO_INDEX), t, value, attempt)
        if "util_pct" in rec:
            pts = st.util.setdefault((node, gpu), deque())
            pts.append((t, float(rec["util_pct"])))
            horizon = t - self.alert_config.low_util_s - 30
            while pts and pts[0][0] < horizon:
                pts.popleft()
        if "mem_used_gib" in rec and "mem_total_gib" in rec:
            st.mem[(node, gpu)] = (t, float(rec["mem_used_gib"]), float(rec["mem_total_gib"]))
        st.dirty = True

    def _on_host(self, run_id: str, node: str, st: _RunState, rec: dict, attempt: int | None) -> None:
        t = float(rec["t"])
        for name, value in rec.items():
            if name not in _NOT_METRIC and rules.number(value) is not None:
                self._add_point(run_id, st, st.key(f"host/{name}", node, NO_INDEX, NO_INDEX), t, value, attempt)

    def _take_offset(self, run_id: str, node: str, st: _RunState, rec: dict) -> bool:
        """Record a file line's offset; False when that line was taken before (a duplicate)."""
        file, offset = str(rec["file"]), int(rec["offset"])
        if offset <= st.high.get(file, 0):
            self.stats["duplicates"] += 1
            return False
        st.high[file] = offset
        self._pending.offsets[(run_id, file)] = (offset, node)
        return True

    def _on_event(self, run_id: str, node: str, st: _RunState, rec: dict, attempt: int | None) -> None:
        if not self._take_offset(run_id, node, st, rec):
            return
        data = rec.get("data")
        if not isinstance(data, dict):  # an unreadable line the agent skipped: only the offset moves
            return
        etype = str(data.get("type", "unknown"))
        rank = data.get("rank", rec.get("rank", NO_INDEX))
        rank = rank if isinstance(rank, int) else NO_INDEX
        t = _value(data.get("time")) or self.clock()
        where = st.placement.get(rank, (node, None))[0]
        step = data.get("step") if isinstance(data.get("step"), int) else None
        derived: list[tuple] = []  # written only if the event row is
        self._pending.events.append(({"run_id": run_id, "node": where, "rank": rank, "file": rec["file"],
                                      "offset": int(rec["offset"]), "type": etype, "t": t,
                                      "data": json.dumps(data, allow_nan=True), "step": step,
                                      "attempt": attempt}, derived))
        self.stats["events"] += 1
        prefix, fields = {"train": ("train", TRAIN_FIELDS), "timing": ("rank", TIMING_FIELDS),
                          "eval": ("train", EVAL_FIELDS)}.get(etype, ("", ()))
        nonfinite = data.get("nonfinite") or {}  # written as null; kept as a gap in the series
        for f in fields:
            if data.get(f) is not None or f in nonfinite:
                self._add_point(run_id, st, st.key(f"{prefix}/{f}", where, NO_INDEX, rank), t, data.get(f), attempt,
                                step, derived)
        experts = data.get("moe_expert_tokens") if etype == "train" else None
        if isinstance(experts, list):
            for expert, count in enumerate(experts):
                self._add_point(run_id, st, st.key(EXPERT_TOKENS, where, expert, rank), t, count, attempt, step,
                                derived)
        if etype == "train" and step is not None:
            # Not a stored sample: history reads the step from the event rows (query.STEP_SERIES).
            self._seq += 1
            st.tail.append((self._seq, st.key(query.STEP_SERIES, where, NO_INDEX, rank), t, float(step)))
        if etype == "start":
            self._seq += 1
            st.start_seq = self._seq
        self._track_event(st, etype, rank, data)

    @staticmethod
    def _track_event(st: _RunState, etype: str, rank: int, data: dict) -> None:
        t = _value(data.get("time"))
        if etype == "start":
            st.running, st.started_t = True, t
            st.train.clear()
            st.timing.clear()
            st.evaluated = None
        elif etype == "end":
            st.running = False
        elif etype == "train":
            st.train.append(data)
        elif etype == "timing":
            st.timing.setdefault(rank, deque(maxlen=16)).append(data)
        elif etype in ("eval", "eval_progress") and isinstance(data.get("step"), int):
            st.evaluated = (t, data["step"])
        elif etype == "checkpoint" and isinstance(data.get("step"), int):
            st.checkpoint = (data["step"], str(data.get("path")))
        st.dirty = True

    def _on_log(self, run_id: str, node: str, st: _RunState, rec: dict, attempt: int | None) -> None:
        # Each attempt's launch writes the node's log anew: its offsets count from the attempt's start.
        if not self._take_offset(run_id, node, st, {"file": log_key(str(rec["file"]), attempt),
                                                    "offset": rec["offset"]}):
            return
        self._on_read_log(run_id, node, st, rec, attempt)

    def _on_read_log(self, run_id: str, node: str, st: _RunState, rec: dict, attempt: int | None) -> None:
        """A log line read from an agent's file: taken once by where it was read (`read`), since a
        Slurm requeue writes the log anew within the attempt."""
        if attempt is not None and self._hung_attempt.get(run_id) == attempt:
            return  # the stop's own lines (stopping_hung)
        finding = rules.log_line(node, str(rec.get("line", "")), self.clock())
        if finding is not None:
            self._add_finding(run_id, st, finding)

    def _on_flight(self, run_id: str, node: str, st: _RunState, rec: dict, attempt: int | None) -> None:
        if rec.get("requested"):  # an answer to the watch's request: the hang diagnosis reads it
            st.flights[int(rec["rank"])] = rec
            return
        self._add_finding(run_id, st, rules.flight_dump(rec, node, st.placement))

    def _on_ranks(self, run_id: str, node: str, st: _RunState, rec: dict, attempt: int | None) -> None:
        for r in rec["ranks"]:
            rank = int(r["rank"])
            st.placement[rank] = (node, r.get("gpu"))
            self._pending.placements[(run_id, rank)] = {
                "run_id": run_id, "rank": rank, "node": node, "local_rank": r.get("local_rank"),
                "gpu": r.get("gpu"), "pid": r.get("pid")}

    def _on_rank_state(self, run_id: str, node: str, st: _RunState, rec: dict, attempt: int | None) -> None:
        t = rules.number(rec.get("t")) or self.clock()
        for r in rec["ranks"]:
            rank, state = int(r["rank"]), str(r["state"])
            before, since = st.rank_states.get(rank, ("", 0.0))
            # a state held since before the watched attempt counts from this attempt's first line
            if before != state or since < self._attempt_started.get(run_id, 0.0):
                st.rank_states[rank] = (state, t)
            st.rank_seen[rank] = t

    def _on_status(self, run_id: str, node: str, st: _RunState, rec: dict, attempt: int | None) -> None:
        status = st.nodes.setdefault(node, {})
        kind = rec["kind"]
        if kind == "hello":
            status.update(gpus=rec.get("gpus"), agent_pid=rec.get("pid"), started=rec.get("t"), ended=None)
        elif kind == "notice":
            status.setdefault("notices", deque(maxlen=20)).append(str(rec.get("message")))
            log.info("agent %s/%s: %s", run_id, node, rec.get("message"))
        elif kind == "bye":
            status["ended"] = rec.get("reason")

    def _add_finding(self, run_id: str, st: _RunState, finding: rules.Finding) -> None:
        if finding.collective:  # a later hang alert names it
            st.last_collective = finding.collective
        self._pending.findings.append((run_id, finding))

    # ------------------------------------------------------------------------------ writing
    def flush(self) -> int:
        """Write everything buffered in one transaction; returns the number of rows written. On a
        database error the batch is kept and retried by the next flush."""
        with self._flush_lock:
            return self._flush_locked()

    def _flush_locked(self) -> int:
        with self._lock:
            batch, self._pending = self._pending, _Pending()
        if not batch:
            return 0
        try:
            with self.engine.begin() as conn:
                # The database has the last word on "exactly once": another process writing the
                # same run (a second studio, the CLI re-attaching) may have stored a line first;
                # then neither the event nor its series rows are written again.
                stored = _insert_events(conn, [row for row, _ in batch.events]) if batch.events else set()
                samples = batch.samples + [p for row, derived in batch.events
                                           if (row["run_id"], row["file"], row["offset"]) in stored for p in derived]
                if samples:
                    _insert_samples(conn, samples)
                _upsert(conn, O, [{"run_id": r, "file": f, "offset": o, "node": n}
                                  for (r, f), (o, n) in batch.offsets.items()],
                        ("run_id", "file"), lambda ex: {"offset": _greatest(O.c.offset, ex.offset), "node": ex.node})
                _upsert(conn, P, list(batch.placements.values()), ("run_id", "rank"),
                        lambda ex: {"node": ex.node, "local_rank": ex.local_rank, "gpu": ex.gpu, "pid": ex.pid})
                _upsert(conn, A, [_alert_row(run_id, f) for run_id, f in batch.findings], ("run_id", "key"),
                        lambda ex: {"last_t": ex.last_t, "count": A.c.count + 1})
                _upsert(conn, A, [_alert_row(run_id, f) for run_id, f in batch.diagnoses], ("run_id", "key"),
                        lambda ex: {"last_t": ex.last_t, "count": A.c.count + 1, "message": ex.message,
                                    "node": ex.node, "rank": ex.rank, "gpu": ex.gpu})
        except Exception:
            self.stats["flush_errors"] += 1
            log.exception("telemetry flush failed; %d samples and %d events kept for the next try",
                          len(batch.samples), len(batch.events))
            with self._lock:
                self._pending = _merge(batch, self._pending)
            return 0
        done = self.clock()
        self.latencies.extend(done - row[5] for row in samples)
        self.stats["flushes"] += 1
        self.stats["duplicates"] += len(batch.events) - len(stored)
        return len(samples) + len(stored)

    # ----------------------------------------------------------------------------- reading
    def offsets(self, run_id: str, node: str, attempt: int | None = None) -> dict[str, int]:
        """Committed offsets to start `node`'s agent of `attempt` from: every event file of the run
        and the node's own log as this attempt wrote it. Flushes first, so nothing taken is left out."""
        self.flush()
        with self.engine.connect() as conn:
            rows = conn.execute(select(O.c.file, O.c.offset).where(O.c.run_id == run_id)).all()
        log = f"logs/{node}.log"
        return {f: o for f, o in rows if f.startswith("events/")} | {
            log: o for f, o in rows if f == log_key(log, attempt)}

    def read_offsets(self, run_id: str, prefix: str) -> dict[str, int]:
        """Committed offsets of the agent files under `prefix` (`read` in `on_agent_line`), to read
        them on from. Flushes first, so nothing taken is left out."""
        self.flush()
        with self.engine.connect() as conn:
            rows = conn.execute(select(O.c.file, O.c.offset).where(O.c.run_id == run_id)).all()
        return {f: o for f, o in rows if f.startswith(prefix)}

    def series(self, run_id: str, names: Iterable[str], since: int | None = None,
               max_points: int = 1000, start: float | None = None, end: float | None = None) -> SeriesResult:
        """Points of the named series (`gpu/util_pct`, or a prefix ending in '*': `gpu/*`).

        since=None: the whole recorded history (or [start, end]), each series reduced to about
        `max_points` bucket means in the database. since=<cursor>: only the points taken after
        that cursor, from memory, so drawing the next second never re-reads the run."""
        names = list(names)
        if since is not None:
            with self._lock:
                st = self._run(run_id)
                # too old for the tail, or not from this ingestor (one before a backend restart)
                reset = since < max(st.evicted_seq, self._seq0, st.start_seq) or since > self._seq
                if not reset:
                    out: dict[SeriesKey, list] = {}
                    for seq, key, t, v in reversed(st.tail):
                        if seq <= since:
                            break
                        if query.match(key.name, names):
                            out.setdefault(key, []).append((t, v))
                    for pts in out.values():
                        pts.reverse()
                    return SeriesResult(self._seq, out)
        with self._flush_lock:
            with self._lock:
                cursor = self._seq
                self._run(run_id)
            self._flush_locked()
            with self.engine.connect() as conn:
                out = query.history(conn, run_id, names, max_points, start, end)
        return SeriesResult(cursor, out, reset=since is not None)

    def alerts(self, run_id: str) -> list[Alert]:
        """Stored alerts of a run, oldest first (flushes pending ones first)."""
        self.flush()
        return query.alerts(self.engine, run_id)

    def events(self, run_id: str, etypes: Iterable[str], limit: int | None = None) -> dict[str, list[dict]]:
        """query.events after a flush: every line taken so far is in the answer."""
        self.flush()
        return query.events(self.engine, run_id, etypes, limit)

    def nodes(self, run_id: str) -> dict[str, dict[str, Any]]:
        """Per node: agent status as last reported (last_seen, gpus, notices, ended)."""
        with self._lock:
            st = self._run(run_id)
            return {n: {k: (list(v) if isinstance(v, deque) else v) for k, v in s.items()} for n, s in st.nodes.items()}

    # ---------------------------------------------------------------------- alerts, compaction
    def window(self, run_id: str, now: float | None = None, devices: bool = True) -> rules.Window:
        """What the rules see. `running` needs a start event without an end event *and* an agent
        heard from within AGENT_SILENT_S: agents exit when the run's processes are gone, so a run
        that died without an end event (killed, node lost) is not mistaken for a hang. Without
        `devices`, the GPU samples (what the time-based rules read) are left out."""
        now = self.clock() if now is None else now
        with self._lock:
            st = self._run(run_id)
            agents = any(not s.get("ended") and now - s.get("last_seen", -math.inf) <= AGENT_SILENT_S
                         for s in st.nodes.values())
            started_t = st.started_t
            if run_id in self._attempt_started:
                # Until the new attempt's `start` event, the steps are the failed attempt's.
                started_t = max(started_t or 0.0, self._attempt_started[run_id])
            return rules.Window(
                now=now, running=st.running and agents, started_t=started_t,
                util={k: list(v) for k, v in st.util.items()} if devices else {},
                mem=dict(st.mem) if devices else {}, train=list(st.train),
                timing={r: list(v) for r, v in st.timing.items()}, placement=dict(st.placement),
                checkpoint=st.checkpoint, evaluated=st.evaluated, last_collective=st.last_collective, rank_states=dict(st.rank_states),
                flights=dict(st.flights), rank_seen=dict(st.rank_seen), flight_request=st.flight_request,
                attempt_t=self._attempt_started.get(run_id))

    def watch_attempt(self, run_id: str, started_at: float, hang_s: float, multiple: float) -> None:
        """A watch follows the attempt started at `started_at`, with the job's own hang limit (its
        `hang_timeout_s`, `hang_step_multiple`) for the hang alert and the watch's stop; the other
        rules keep this ingestor's limits. The rules count steps from the attempt's start on: an
        automatic restart's startup is not a hang of the attempt that failed."""
        with self._lock:
            self._alert_configs[run_id] = replace(self.alert_config, hang_s=hang_s, hang_multiple=multiple)
            self._attempt_started[run_id] = started_at

    def hang(self, run_id: str, since: float, now: float | None = None) -> rules.Finding | None:
        """The hang rule's finding for the attempt started at `since` (what the watch stops a hung
        run on), or None. Until that attempt's `start` event arrives the window still holds the
        attempt before it (killed: no `end` event), whose steps must not count."""
        window = self.window(run_id, now, devices=False)  # asked every watch round: no device series copied
        window = replace(window, started_t=max(window.started_t or since, since), attempt_t=since)
        found = rules.hang(window, self._alert_configs.get(run_id, self.alert_config))
        return found[0] if found else None

    def awaiting_flight(self, run_id: str, request: str) -> bool:
        """Whether a rank of the watched attempt whose process runs has not yet answered the
        flight recorder request `request` (a stopped or exited rank cannot); the hang rule reads the
        answers to this request from now on."""
        with self._lock:
            st = self._run(run_id)
            st.flight_request = request
            started = self._attempt_started.get(run_id, 0.0)
            answered = {r for r, rec in st.flights.items() if rec.get("request") == request}
            return any(r not in answered and seen >= started and st.rank_states.get(r, ("running",))[0] == "running"
                       for r, seen in st.rank_seen.items())

    def stopping_hung(self, run_id: str, attempt: int, finding: rules.Finding) -> None:
        """A watch stops `attempt` of the run as hung, on `finding`: that becomes the run's hang
        alert (the rules may have raised it first, with less: the flight recorder answers come
        after). The lines its stop makes the other ranks log (peer lost, rendezvous failed, a
        collective timeout) are the stop's consequences, not causes: they stay in the log and raise
        no alert; the hang alert and the attempt's failure name the cause."""
        with self._lock:
            self._hung_attempt[run_id] = attempt
            self._pending.diagnoses.append((run_id, finding))

    def evaluate(self, run_id: str, now: float | None = None) -> list[rules.Finding]:
        """Run the alert rules on a run's window and queue the findings for storage."""
        findings = rules.evaluate(self.window(run_id, now), self._alert_configs.get(run_id, self.alert_config))
        with self._lock:
            st = self._run(run_id)
            st.dirty = False
            for f in findings:
                self._add_finding(run_id, st, f)
        return findings

    def compact(self, run_id: str, now: float | None = None) -> int:
        """Replace clock-sampled rows older than the raw horizon with bucket means; returns the
        number of rows removed."""
        now = self.clock() if now is None else now
        ds = self.downsampling
        removed = 0
        with self._flush_lock, self.engine.begin() as conn:
            for bucket_s, older_than in ((ds.mid_bucket_s, ds.raw_s), (ds.old_bucket_s, ds.old_after_s)):
                cutoff = math.floor((now - older_than) / bucket_s) * bucket_s
                cond = [S.c.run_id == run_id, S.c.res_s < bucket_s, S.c.t < cutoff,
                        or_(*(S.c.name.like(p + "%") for p in SAMPLED_PREFIXES))]
                # a mean weighted by the time each row stands for (1 s for a raw sample); rows
                # without a value (NaN) carry no weight
                weight = case((S.c.value.is_(None), 0.0), else_=_greatest(S.c.res_s, 1.0))
                bucket = query.bucket_of(conn, S.c.t, 0.0, bucket_s)
                keys = (S.c.node, S.c.gpu, S.c.rank, S.c.name)
                agg = select(*keys, func.sum(S.c.value * weight) / func.nullif(func.sum(weight), 0.0),
                             func.max(S.c.attempt), bucket).where(*cond).group_by(*keys, bucket)
                rows = conn.execute(agg).all()
                if not rows:
                    continue
                conn.execute(insert(S), [
                    {"run_id": run_id, "node": node, "gpu": gpu, "rank": rank, "name": name,
                     "t": (int(b) + 0.5) * bucket_s, "value": v, "step": None, "res_s": bucket_s, "attempt": attempt}
                    for node, gpu, rank, name, v, attempt, b in rows])
                # the new rows have res_s == bucket_s, so `cond` leaves them alone
                removed += conn.execute(delete(S).where(*cond)).rowcount - len(rows)
        return removed

    # ---------------------------------------------------------------------- background thread
    def start(self) -> "Ingestor":
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="telemetry-ingest", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self.flush()

    def _loop(self) -> None:
        next_eval = self.clock() + self.eval_interval_s
        while not self._stop.wait(self.flush_interval_s):
            try:
                self._tick_tail()
                now = self.clock()
                if now >= next_eval:
                    next_eval = now + self.eval_interval_s
                    with self._lock:
                        dirty = [r for r, st in self._runs.items() if st.dirty or st.running]
                    for run_id in dirty:
                        self.evaluate(run_id, now)
                self.flush()
                with self._lock:
                    due = [r for r, st in self._runs.items() if now - st.last_compact >= self.compact_interval_s]
                    for r in due:
                        self._runs[r].last_compact = now
                for run_id in due:
                    self.compact(run_id, now)
            except Exception:  # keep ingesting; the error is in the log
                log.exception("telemetry background pass failed")

    def _tick_tail(self) -> None:
        """Drop tail points older than `tail_s` (or beyond the point cap)."""
        horizon = self.clock() - self.tail_s
        with self._lock:
            for st in self._runs.values():
                tail = st.tail
                while tail and (tail[0][2] < horizon or len(tail) > self.tail_max_points):
                    st.evicted_seq = tail.popleft()[0]


_HANDLERS = {
    "gpu": Ingestor._on_gpu, "host": Ingestor._on_host, "event": Ingestor._on_event, "log": Ingestor._on_log,
    "ranks": Ingestor._on_ranks, "rank_state": Ingestor._on_rank_state, "flight": Ingestor._on_flight,
    "hello": Ingestor._on_status, "notice": Ingestor._on_status, "bye": Ingestor._on_status, "heartbeat": None,
}


def _dialect_insert(conn, table):
    """INSERT with ON CONFLICT support, on the databases that have it (None elsewhere)."""
    if conn.dialect.name == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as dialect_insert
    elif conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as dialect_insert
    else:
        return None
    return dialect_insert(table)


def _greatest(a, b):
    return case((a < b, b), else_=a)


def _upsert(conn, table, rows: list[dict], keys: tuple[str, ...], new_values) -> None:
    """Insert rows, or update the row with the same `keys` to `new_values(excluded)` (a mapping
    of column -> SQL expression, where `excluded.<column>` is the value offered)."""
    if not rows:
        return
    ins = _dialect_insert(conn, table)
    if ins is not None:
        conn.execute(ins.on_conflict_do_update(index_elements=[table.c[k] for k in keys],
                                               set_=new_values(ins.excluded)), rows)
        return
    for row in rows:
        offered = SimpleNamespace(**{c: literal(v, table.c[c].type) for c, v in row.items()})
        if conn.execute(update(table).where(*(table.c[k] == row[k] for k in keys))
                        .values(new_values(offered))).rowcount == 0:
            conn.execute(insert(table).values(**row))


def _insert_events(conn, rows: list[dict]) -> set[tuple[str, str, int]]:
    """Insert event rows, skipping lines already stored; returns (run, file, offset) of those written."""
    ins = _dialect_insert(conn, E)
    if ins is not None:
        return {tuple(r) for r in conn.execute(
            ins.on_conflict_do_nothing().returning(E.c.run_id, E.c.file, E.c.offset), rows)}
    stored = set()
    for row in rows:
        try:
            with conn.begin_nested():
                conn.execute(insert(E).values(**row))
            stored.add((row["run_id"], row["file"], row["offset"]))
        except IntegrityError:
            continue
    return stored


def _alert_row(run_id: str, f: rules.Finding) -> dict:
    return {"run_id": run_id, "key": f.key, "rule": f.rule, "severity": f.severity, "t": f.t, "last_t": f.t,
            "count": 1, "message": f.message, "node": f.node, "rank": f.rank, "gpu": f.gpu, "detail": f.detail}


def _insert_samples(conn, rows: list[tuple]) -> None:
    """The hot path (thousands of rows a second): SQLite's executemany on plain tuples is about
    3x faster than SQLAlchemy's per-row parameter handling; other databases go through Core."""
    if conn.dialect.paramstyle == "qmark":
        conn.exec_driver_sql(_QMARK_INSERT, rows)
    else:
        conn.execute(insert(S), [dict(zip(SAMPLE_COLUMNS, r)) for r in rows])


_QMARK_INSERT = (f"INSERT INTO {S.name} ({', '.join(SAMPLE_COLUMNS)}) "
                 f"VALUES ({', '.join('?' * len(SAMPLE_COLUMNS))})")


def _merge(old: _Pending, new: _Pending) -> _Pending:
    old.samples += new.samples
    old.events += new.events
    old.offsets.update(new.offsets)
    old.placements.update(new.placements)
    old.findings += new.findings
    old.diagnoses += new.diagnoses
    return old
