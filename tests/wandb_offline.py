"""Read back what an offline wandb run logged (its run-*.wandb file), to test logging without a server.

The file is a LevelDB-style log: a 7-byte header, then 32 KiB blocks of records, each with a CRC32,
a little-endian 2-byte length and a type (1 full, 2 first, 3 middle, 4 last) before its payload;
each payload is a serialized wandb Record protobuf.
"""
import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

HEADER, BLOCK, RECORD_HEADER = 7, 32 * 1024, 7


def records(path):
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    pos, pending = HEADER, b""
    while pos + RECORD_HEADER <= len(data):
        left_in_block = BLOCK - (pos % BLOCK)
        if left_in_block < RECORD_HEADER:  # block trailer padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + RECORD_HEADER])
        payload = data[pos + RECORD_HEADER:pos + RECORD_HEADER + length]
        pos += RECORD_HEADER + length
        if kind == 0 and length == 0:
            continue
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            yield rec


def history(run_file) -> list[dict]:
    """Every logged row: {'_step': n, key: value, ...} in logging order."""
    rows = []
    for rec in records(run_file):
        if rec.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item}
            rows.append(row)
    return rows
