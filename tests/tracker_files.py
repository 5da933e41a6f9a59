"""Reading back what report_to's trackers wrote, with each tool's own reader or record type."""
from __future__ import annotations

import json
import struct
from pathlib import Path


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
