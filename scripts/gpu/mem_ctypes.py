#!/usr/bin/env python3
"""Check 3: the driver API called straight through ctypes, no CUDA runtime.

Usage: mem_ctypes.py [default|deepbind]
  deepbind: load libcuda.so.1 with RTLD_NOW | RTLD_DEEPBIND.
Prints key=value lines.  Two paths are exercised in one process:
  direct_*: the exported symbols (cuMemAlloc_v2, ...) called through ctypes;
  pa_*:     pointers from cuGetProcAddress_v2("cuMemAlloc", ..., 13000, 0, &status).
Each path: cuDeviceTotalMem_v2, cuMemGetInfo_v2, cuMemAlloc_v2 of 3 GiB, then
2 GiB more (over a 4 GiB quota this one must fail with 2), then free both.
"""
import ctypes
import os
import sys

GiB = 1 << 30
c_size_p = ctypes.POINTER(ctypes.c_size_t)
c_dptr = ctypes.c_uint64  # CUdeviceptr


def out(key, value):
    print(f"{key}={value}", flush=True)


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "default"
    out("mode", mode)
    if mode == "deepbind":
        cu = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOW | os.RTLD_DEEPBIND)
    else:
        cu = ctypes.CDLL("libcuda.so.1")

    def fn(name, *argtypes):
        f = getattr(cu, name)
        f.restype = ctypes.c_int
        f.argtypes = list(argtypes)
        return f

    cuInit = fn("cuInit", ctypes.c_uint)
    cuDeviceGet = fn("cuDeviceGet", ctypes.POINTER(ctypes.c_int), ctypes.c_int)
    cuPrimaryRetain = fn("cuDevicePrimaryCtxRetain", ctypes.POINTER(ctypes.c_void_p), ctypes.c_int)
    cuCtxSetCurrent = fn("cuCtxSetCurrent", ctypes.c_void_p)
    cuGetProcAddress = fn("cuGetProcAddress_v2", ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p),
                          ctypes.c_int, ctypes.c_uint64, ctypes.POINTER(ctypes.c_int))

    rc = cuInit(0)
    out("init_rc", rc)
    dev = ctypes.c_int(-1)
    out("device_get_rc", cuDeviceGet(ctypes.byref(dev), 0))
    ctx = ctypes.c_void_p()
    out("retain_rc", cuPrimaryRetain(ctypes.byref(ctx), dev.value))
    out("set_current_rc", cuCtxSetCurrent(ctx))
    if rc != 0:
        out("error", "cuInit failed")
        return 1

    # Typed prototypes shared by both paths.
    TotalMemT = ctypes.CFUNCTYPE(ctypes.c_int, c_size_p, ctypes.c_int)
    GetInfoT = ctypes.CFUNCTYPE(ctypes.c_int, c_size_p, c_size_p)
    AllocT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(c_dptr), ctypes.c_size_t)
    FreeT = ctypes.CFUNCTYPE(ctypes.c_int, c_dptr)

    def run_path(prefix, total_mem, get_info, alloc, free):
        total = ctypes.c_size_t(0)
        out(f"{prefix}_total_mem_rc", total_mem(ctypes.byref(total), dev.value))
        out(f"{prefix}_total_mem", total.value)
        f, t = ctypes.c_size_t(0), ctypes.c_size_t(0)
        out(f"{prefix}_info_rc", get_info(ctypes.byref(f), ctypes.byref(t)))
        out(f"{prefix}_info_free", f.value)
        out(f"{prefix}_info_total", t.value)
        p3, p2 = c_dptr(0), c_dptr(0)
        r3 = alloc(ctypes.byref(p3), 3 * GiB)
        out(f"{prefix}_alloc3g_rc", r3)
        r2 = alloc(ctypes.byref(p2), 2 * GiB)
        out(f"{prefix}_alloc2g_rc", r2)
        f1 = ctypes.c_size_t(0)
        get_info(ctypes.byref(f1), ctypes.byref(t))
        out(f"{prefix}_info_free_held", f1.value)
        if r2 == 0:
            out(f"{prefix}_free2g_rc", free(p2))
        if r3 == 0:
            out(f"{prefix}_free3g_rc", free(p3))
        f2 = ctypes.c_size_t(0)
        get_info(ctypes.byref(f2), ctypes.byref(t))
        out(f"{prefix}_info_free_after", f2.value)
        out(f"{prefix}_free_back_diff", f2.value - f.value)

    # 1) exported symbols through ctypes
    run_path("direct",
             TotalMemT(("cuDeviceTotalMem_v2", cu)),
             GetInfoT(("cuMemGetInfo_v2", cu)),
             AllocT(("cuMemAlloc_v2", cu)),
             FreeT(("cuMemFree_v2", cu)))

    # 2) pointers from cuGetProcAddress_v2
    def proc(symbol, proto):
        pfn = ctypes.c_void_p(0)
        status = ctypes.c_int(-1)
        r = cuGetProcAddress(symbol.encode(), ctypes.byref(pfn), 13000, 0, ctypes.byref(status))
        out(f"pa_lookup_{symbol}", f"rc={r},status={status.value},ptr={pfn.value or 0:#x}")
        if r != 0 or not pfn.value:
            return None
        return proto(pfn.value)

    ptrs = [proc("cuDeviceTotalMem", TotalMemT), proc("cuMemGetInfo", GetInfoT),
            proc("cuMemAlloc", AllocT), proc("cuMemFree", FreeT)]
    # Where the pointers point compared with the exported _v2 symbols.
    exported = ctypes.cast(cu.cuMemAlloc_v2, ctypes.c_void_p).value
    out("exported_cuMemAlloc_v2", f"{exported or 0:#x}")
    if all(p is not None for p in ptrs):
        run_path("pa", *ptrs)
    else:
        out("error", "cuGetProcAddress_v2 lookup failed")
    out("done", 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
