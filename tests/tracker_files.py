"""Reading back what report_to's trackers wrote, with each tool's own reader or record type."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterator


def wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of the run's offline W&B files, read with W&B's own record type. wandb 0.31
    has no Python reader for them: they are LevelDB-log files (a 7-byte ':W&B' header, 32 KiB
    blocks of records: crc32c, length, kind) of `wandb_internal_pb2.Record`s."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for path in sorted((run_dir / "trackers" / "wandb").glob("offline-run-*/run-*.wandb")):
        data = path.read_bytes()
        assert data[:4] == b":W&B", path
        pos, block, pending = 7, 32768, b""
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # a block's tail too short for a header is padding
                pos += block - pos % block
                continue
            _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if length == 0 and kind == 0:
                break
            pending += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # FULL, LAST
                record = pb.Record()
                record.ParseFromString(pending)
                pending = b""
                if record.WhichOneof("record_type") == "history":
                    rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                 for item in record.history.item})
    return rows


def swanlab_files(run_dir: Path) -> list[Path]:
    """The run's offline SwanLab experiments (one per attempt), oldest first: their directory names
    order them only to the second."""
    return sorted((run_dir / "trackers" / "swanlab").glob("run-*/run-*.swanlab"), key=lambda p: p.stat().st_mtime_ns)


def swanlab_records(run_dir: Path) -> Iterator:
    """Every record of the run's offline SwanLab experiments, oldest first, read with SwanLab's own
    reader and record type."""
    from swanlab.proto.swanlab.record.v1 import record_pb2 as pb
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    for path in swanlab_files(run_dir):
        reader = DataStoreReader()
        reader.open(path)
        try:
            while (data := reader.scan()) is not None:
                record = pb.Record()
                record.ParseFromString(data)
                yield record
        finally:
            reader.close()


def swanlab_scalars(run_dir: Path, key: str) -> list[tuple[int, float]]:
    """(step, value) of `key` in the run's offline SwanLab experiments."""
    return [(r.scalar.step, r.scalar.value.number) for r in swanlab_records(run_dir)
            if r.WhichOneof("record_type") == "scalar" and r.scalar.key == key]


def swanlab_finish_states(run_dir: Path) -> list[str]:
    """Each offline SwanLab experiment's recorded end ('RUN_STATE_FINISHED', ...), one per attempt."""
    return [r.finish.DESCRIPTOR.fields_by_name["state"].enum_type.values_by_number[r.finish.state].name
            for r in swanlab_records(run_dir) if r.WhichOneof("record_type") == "finish"]
