"""One SwanLab experiment, driven over stdin by `backend.telemetry.trackers.SwanlabSink`.

SwanLab's SDK holds one run per process, and a studio reports several runs at once: each run's
SwanLab experiment lives in a process of its own. Requests and answers are JSON lines; SwanLab's own
console output goes to stderr (the sink's log file), never into the answers.

    {"op": "init", "kwargs": {...}, "probe": {...}}  swanlab.init           -> {"ok": true, "where": ...}
    {"op": "log", "rows": [[key, step, value]]}  swanlab.log per step      -> {"ok": true}
    {"op": "finish", "state": "success", "error": null}                    -> {"ok": true}, then exits
An error answers {"ok": false, "error": "..."}; end of input finishes the experiment as aborted.
"""
from __future__ import annotations

import json
import os
import sys


def url(run) -> str:
    """The experiment's page; SwanLab raises for a run that is not online."""
    try:
        return str(run.url or "")
    except ValueError:
        return ""


def serve(requests, answer) -> None:
    import swanlab

    run = None
    for line in requests:
        request = json.loads(line)
        try:
            if request["op"] == "init":
                # what SwanLab would probe is the studio's machine, not the run's nodes
                settings = swanlab.Settings(probe=swanlab.Settings.Probe(**request.get("probe", {})))
                run = swanlab.init(**request["kwargs"], settings=settings)
                answer({"ok": True, "where": url(run) or request["kwargs"].get("log_dir", "")})
            elif request["op"] == "log":
                by_step: dict[int, dict[str, float]] = {}
                for key, step, value in request["rows"]:
                    by_step.setdefault(int(step), {})[key] = value
                for step, values in by_step.items():
                    run.log(values, step=step)
                answer({"ok": True})
            elif request["op"] == "finish":
                run.finish(state=request["state"], error=request.get("error"))
                answer({"ok": True})
                return
            else:
                answer({"ok": False, "error": f"unknown request {request['op']!r}"})
        except Exception as exc:  # noqa: BLE001 - the sink names it in the run's notices
            answer({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    if run is not None:
        run.finish(state="aborted")


def main() -> None:
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # SwanLab prints to stdout

    def answer(message: dict) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    serve(sys.stdin, answer)


if __name__ == "__main__":
    main()
