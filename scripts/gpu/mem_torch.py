#!/usr/bin/env python3
"""Check 5: PyTorch under a memory quota.  Prints key=value lines.

total: torch.cuda.mem_get_info()[1] (4294967296 expected with a 4 GiB quota);
alloc2g: a 2 GiB uint8 tensor (ok expected); over: torch.empty of 5 GiB
('oom' = torch.OutOfMemoryError, 'ok' = it succeeded, 'error:<type>' otherwise).
"""
import sys

GiB = 1 << 30


def out(key, value):
    print(f"{key}={value}", flush=True)


def main():
    import torch

    out("torch_version", torch.__version__)
    out("cuda_available", int(torch.cuda.is_available()))
    free, total = torch.cuda.mem_get_info()
    out("free", free)
    out("total", total)
    oom_type = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError

    try:
        x = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
        x.fill_(1)
        torch.cuda.synchronize()
        out("alloc2g", "ok")
    except Exception as e:  # noqa: BLE001 - report whatever happened
        out("alloc2g", f"error:{type(e).__name__}")
        out("alloc2g_msg", str(e).splitlines()[0] if str(e) else "")
        x = None
    free2, total2 = torch.cuda.mem_get_info()
    out("free_held", free2)
    out("total_held", total2)

    try:
        y = torch.empty(5 * GiB, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        out("over", "ok")
        del y
    except oom_type as e:
        out("over", "oom")
        out("over_msg", str(e).splitlines()[0] if str(e) else "")
    except Exception as e:  # noqa: BLE001
        out("over", f"error:{type(e).__name__}")
        out("over_msg", str(e).splitlines()[0] if str(e) else "")
    del x
    torch.cuda.empty_cache()
    free3, _ = torch.cuda.mem_get_info()
    out("free_after", free3)
    out("done", 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
