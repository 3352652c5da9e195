#!/usr/bin/env python3
"""Writes the seed corpus of the fuzz targets (tests/fuzz/corpus/<target>/): a few small valid
inputs each, so that libFuzzer starts from messages and files the parsers accept.

  tests/fuzz/make_corpus.py          (rewrites corpus/; the files are committed)
"""
import gzip
import os
import struct
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))


def put(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# ---- store frames (net/rendezvous/store.h): magic, version, type, id, length, payload.
def s(b):
    return struct.pack("<I", len(b)) + b


def frame(t, payload, rid=1):
    return struct.pack("<IHHII", 0x51524E47, 2, t, rid, len(payload)) + payload


JOIN, SET, GET, WAIT, CHECK, ADD, MISSING = 1, 2, 3, 4, 5, 6, 8
keys = lambda *ks: struct.pack("<I", len(ks)) + b"".join(s(k) for k in ks)
put("fuzz_store", "join", b"\x00" + frame(JOIN, struct.pack("<Iqq", 2, 0, 2) + s(b"fuzz") +
                                          s(b"host") + s(b"n" * 16) + s(b"p" * 32)))
put("fuzz_store", "set_get", b"\x03" + frame(SET, s(b"host/0") + s(b"qhost1")) +
    frame(GET, s(b"host/0"), 2))
put("fuzz_store", "wake", b"\x03" + frame(SET, s(b"fabric/addr/0") + s(b"tcp\nabc")) +
    frame(SET, s(b"host/0") + s(b"h"), 2) + frame(CHECK, keys(b"host/0", b"x"), 3))
put("fuzz_store", "add_missing", b"\x05" + frame(ADD, s(b"counter") + struct.pack("<q", 5)) +
    frame(ADD, s(b"counter") + struct.pack("<q", -2), 2) +
    frame(MISSING, keys(b"counter", b"nope"), 3) + frame(WAIT, keys(b"late"), 4))
put("fuzz_store", "foreign_key", b"\x03" + frame(SET, s(b"fabric/addr/1") + s(b"x")))

# ---- quorum wire (collectives/quorum/wire.cc), world 4 (byte 0 = world - 1 | direction).
UPW = struct.Struct("<IHBBIIQQqIi")  # 48 bytes
def up(t, rank=1, step=7, count=100, completed=6, attempt=0, suspect=-1, have=0, extra=b""):
    return UPW.pack(0x50555251, 4, t, have, rank, 4, step, count, completed, attempt, suspect) + extra
world4_up = bytes([3 | (1 << 7)])  # world 4, up, from rank 1
put("fuzz_quorum_wire", "ready", world4_up + up(1, attempt=(0 << 8) | 1))
put("fuzz_quorum_wire", "ready_digest", world4_up + up(1, extra=struct.pack("<Q", 0x1234)))
put("fuzz_quorum_wire", "heartbeat", world4_up + up(2))
put("fuzz_quorum_wire", "shard", world4_up + up(8, step=600, count=3, attempt=1,
                                                 extra=struct.pack("<2d", 1.5, 2.5)))
put("fuzz_quorum_wire", "ack", world4_up + up(6, count=2, extra=struct.pack("<QII", 5, 1, 0) + b"\x0f"))
DNW = struct.Struct("<IHBBIIQQqqiiQIIII")  # 80 bytes
def down(t, status=0, step=7, epoch=0, body=b"", attempt=0, source=-1, bad_rank=-1):
    return DNW.pack(0x4E445251, 4, t, status, 4, attempt, step, epoch, 100, 5, bad_rank, source,
                    0, 3, len(body), 0, 0) + body
world4_down = bytes([3 | 64])  # world 4, down, from rank 0
decide_body = b"\x0f" + b"\x00" + struct.pack("<4q", 0, 10, 20, -1)
put("fuzz_quorum_wire", "decide", world4_down + down(1, body=decide_body))
put("fuzz_quorum_wire", "view", world4_down + down(2, epoch=1, body=b"\x07" +
                                                  struct.pack("<IId", 3, 1, 300.0)))
put("fuzz_quorum_wire", "fatal", world4_down + down(5, body=b"replicas drifted"))
put("fuzz_quorum_wire", "takeover", world4_down + down(8, epoch=2, body=b"\x0e"))

# ---- IDX files (train/idx.h): 2 zero bytes, type 0x08, dims, big-endian sizes, data.
def idx(dims, data):
    return bytes([0, 0, 8, len(dims)]) + b"".join(struct.pack(">I", d) for d in dims) + data
put("fuzz_idx", "labels", idx([6], bytes([0, 1, 2, 3, 9, 4])))
put("fuzz_idx", "images", idx([2, 3, 3], bytes(range(18))))
put("fuzz_idx", "labels_gz", gzip.compress(idx([4], bytes([1, 2, 3, 4])), mtime=0))

# ---- checkpoints (train/checkpoint.h); byte 0 odd: the harness fixes the CRC.
def arr_f32(v):
    return struct.pack("<Q", len(v)) + struct.pack("<%df" % len(v), *v)
payload = (struct.pack("<QqqQII", 12, 1, 3, 0xABCDEF, 4, 2) + arr_f32([1.0, 2.0, 3.0]) +
           arr_f32([0.5, 0.5, 0.5]) + arr_f32([]) + struct.pack("<Q", 2) + b"\x01\x02" +
           struct.pack("<Q", 2) + b"{}")
body = b"QRINGCK\x00" + struct.pack("<IIQ", 1, 0, len(payload)) + payload
ck = body + struct.pack("<I", zlib.crc32(body) & 0xFFFFFFFF)
put("fuzz_checkpoint", "valid", b"\x00" + ck)
put("fuzz_checkpoint", "fix_crc", b"\x01" + ck)

# ---- configurations (train/config.cc): TOML, then "---" and overrides.
with open(os.path.join(HERE, "..", "..", "configs", "smoke.toml"), "rb") as f:
    smoke = f.read()
put("fuzz_config", "smoke", smoke)
put("fuzz_config", "overrides", smoke + b"\n---\nquorum.quorum=3\ntrain.lr=0.2\nstraggler.model=exp:5\n")
put("fuzz_config", "small", b"[train]\nsteps = 10\n[quorum]\ndeadline_ms = 1000\n")

# ---- issue 44's limits: deep nesting and long dotted keys (train/config_limits.h), in a file
# and as an override; and honest IDX headers against a memory budget (fuzz_idx_budget).
put("fuzz_config", "nested_arrays", b"[run]\nname = " + b"[" * 40 + b"]" * 40 + b"\n")
put("fuzz_config", "nested_tables", b"[run]\nname = " + b"{a=" * 40 + b"1" + b"}" * 40 + b"\n")
put("fuzz_config", "dotted_key", b".".join([b"a"] * 40) + b" = 1\n")
put("fuzz_config", "nested_override", smoke + b"\n---\nmodel.hidden=" + b"[" * 40 + b"]" * 40 + b"\n")
put("fuzz_config", "brackets_in_strings", b"[run]\nname = \"[[[[{{{{\" # ]]]]\n")
put("fuzz_toml_nesting", "deep_arrays", bytes([0xF0]) * 3 + bytes([0xF1]) * 3)
put("fuzz_toml_nesting", "deep_tables", bytes([0xF2]) * 3 + bytes([9]) + bytes([0xF3]) * 3)
put("fuzz_toml_nesting", "dotted", bytes([5]) + bytes([0xF4]) * 3 + bytes([6, 9]))
put("fuzz_toml_nesting", "hidden", bytes([0xFA, 0xFB, 0xFC, 0xFF, 0x10, 0x11]))
budget = lambda kib: struct.pack("<I", kib)
put("fuzz_idx_budget", "small", b"\x00" + struct.pack("<4I", 64, 64, 16, 16) + b"\x1c\x1c" +
    budget(1024))
put("fuzz_idx_budget", "million", b"\x00" + struct.pack("<4I", 1000000, 1000000, 10000, 10000) +
    b"\x1c\x1c" + budget(65535))
put("fuzz_idx_budget", "mismatch", b"\x00" + struct.pack("<4I", 1000000, 60000, 16, 16) +
    b"\x1c\x1c" + budget(1024))
put("fuzz_idx_budget", "trailing", b"\x04" + struct.pack("<4I", 8, 8, 2, 2) + b"\x1c\x1c" +
    budget(1024) + b"extra")
