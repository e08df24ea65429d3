#!/usr/bin/env python3
"""Does the CUDA driver hand out new physical memory (cuMemCreate) cleared?

Run on a GPU machine (needs only libcuda and Python): python3 scripts/probe-fresh-chunks.py

The pool clears a chunk whose bytes were someone else's before anyone sees it. Whether a chunk
fresh from cuMemCreate counts as "someone else's" is a question about the driver: CUDA promises
nothing. This probe writes a pattern into physical memory, releases it, creates the same amount
again (64 GiB of an 80 GB card: it must reuse the pattern's pages) and counts the bytes that are
not zero in the first 64 KiB of every 2 MiB, in one process and across processes; it also times
the create against clearing the same bytes.
"""
import ctypes as C
import os
import sys
import time

cu = C.CDLL("libcuda.so.1")


def ck(r, what):
    if r != 0:
        s = C.c_char_p()
        cu.cuGetErrorName(r, C.byref(s))
        raise SystemExit(f"{what}: {s.value.decode() if s.value else r}")


class Loc(C.Structure):
    _fields_ = [("type", C.c_int), ("id", C.c_int)]


class Flags(C.Structure):
    _fields_ = [("compressionType", C.c_ubyte), ("gpuDirectRDMACapable", C.c_ubyte),
                ("usage", C.c_ushort), ("reserved", C.c_ubyte * 4)]


class Prop(C.Structure):
    _fields_ = [("type", C.c_int), ("requestedHandleTypes", C.c_int), ("location", Loc),
                ("win32HandleMetaData", C.c_void_p), ("allocFlags", Flags)]


class Access(C.Structure):
    _fields_ = [("location", Loc), ("flags", C.c_int)]


def init():
    ck(cu.cuInit(0), "cuInit")
    dev = C.c_int()
    ck(cu.cuDeviceGet(C.byref(dev), 0), "cuDeviceGet")
    ctx = C.c_void_p()
    ck(cu.cuDevicePrimaryCtxRetain(C.byref(ctx), dev), "retain")
    ck(cu.cuCtxSetCurrent(ctx), "set current")


PROP = Prop(type=1, requestedHandleTypes=0, location=Loc(type=1, id=0))  # pinned, device 0
ACC = Access(location=Loc(type=1, id=0), flags=3)  # read-write
GRAN = 2 << 20


def create(sizes):
    hs = []
    for s in sizes:
        h = C.c_ulonglong()
        ck(cu.cuMemCreate(C.byref(h), C.c_size_t(s), C.byref(PROP), C.c_ulonglong(0)), "create")
        hs.append(h)
    return hs


def map_all(hs, sizes):
    total = sum(sizes)
    va = C.c_ulonglong()
    ck(cu.cuMemAddressReserve(C.byref(va), C.c_size_t(total), C.c_size_t(0), C.c_ulonglong(0),
                              C.c_ulonglong(0)), "reserve")
    at = va.value
    for h, s in zip(hs, sizes):
        ck(cu.cuMemMap(C.c_ulonglong(at), C.c_size_t(s), C.c_size_t(0), h, C.c_ulonglong(0)), "map")
        at += s
    ck(cu.cuMemSetAccess(va, C.c_size_t(total), C.byref(ACC), C.c_size_t(1)), "access")
    return va.value, total


def unmap_release(va, total, hs):
    ck(cu.cuMemUnmap(C.c_ulonglong(va), C.c_size_t(total)), "unmap")
    ck(cu.cuMemAddressFree(C.c_ulonglong(va), C.c_size_t(total)), "address free")
    for h in hs:
        ck(cu.cuMemRelease(h), "release")


def nonzero(va, total):
    """Bytes not zero in the first 64 KiB of every 2 MiB (every chunk is looked at)."""
    piece, step = 64 << 10, 2 << 20
    buf = C.create_string_buffer(piece)
    bad = 0
    for off in range(0, total, step):
        ck(cu.cuMemcpyDtoH_v2(buf, C.c_ulonglong(va + off), C.c_size_t(piece)), "copy")
        bad += piece - buf.raw.count(0)
    return bad


def fill(va, total, byte):
    t = time.perf_counter()
    ck(cu.cuMemsetD8_v2(C.c_ulonglong(va), C.c_ubyte(byte), C.c_size_t(total)), "memset")
    ck(cu.cuCtxSynchronize(), "sync")
    return time.perf_counter() - t


def round_trip(label, sizes):
    hs = create(sizes)
    va, total = map_all(hs, sizes)
    fill(va, total, 0xAB)
    if nonzero(va, total) != total // 32:  # the control: the reading sees the pattern
        raise SystemExit(f"{label}: the pattern written does not read back")
    unmap_release(va, total, hs)
    t = time.perf_counter()
    hs = create(sizes)
    made = time.perf_counter() - t
    va, total = map_all(hs, sizes)
    bad = nonzero(va, total)
    clear = fill(va, total, 0)
    unmap_release(va, total, hs)
    print(f"RESULT fresh-chunks {label}: {bad} of {total // 32} bytes looked at not zero after a release of 0xAB "
          f"and a new create; create {made * 1e3:.3f} ms, clearing the same bytes {clear * 1e3:.3f} ms",
          flush=True)
    return bad


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--writer":
        init()
        sizes = [GRAN] * int(sys.argv[2])
        hs = create(sizes)
        va, total = map_all(hs, sizes)
        fill(va, total, 0xCD)
        os._exit(0)  # exit with the memory still held: the driver reclaims it
    init()
    bad = 0
    # Another process writes 4 GiB and exits without freeing; this one takes memory after it.
    r = os.spawnv(os.P_WAIT, sys.executable, [sys.executable, __file__, "--writer", "2048"])
    if r != 0:
        raise SystemExit(f"writer exited {r}")
    sizes = [GRAN] * 2048
    hs = create(sizes)
    va, total = map_all(hs, sizes)
    n = nonzero(va, total)
    unmap_release(va, total, hs)
    print(f"RESULT fresh-chunks after another process: {n} of {total // 32} bytes looked at not zero", flush=True)
    bad += n
    # Most of the card: the new handles must reuse pages the pattern was in.
    bad += round_trip("same process, 64 x 1 GiB", [1 << 30] * 64)
    bad += round_trip("same process, 2048 x 2 MiB", [GRAN] * 2048)
    for _ in range(3):
        bad += round_trip("same process, one 8 GiB handle", [8 << 30])
    print("fresh chunks read as zero everywhere" if bad == 0 else f"{bad} bytes were not zero")


main()
