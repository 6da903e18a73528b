"""Check 37: JAX and CuPy, each in a process of its own, do work that fits a
4 GiB quota (JAX's default preallocation of 75% of the memory it is shown,
an 8192^2 float32 matmul; CuPy a 1 GiB array and a 4096^2 matmul) and print
key=value lines: <fw>=ok or <fw>=error:<type>, the device total they see
(MiB), and a checksum.

Usage: python3 mem_frameworks.py jax|cupy
"""

import sys


def jax_run():
    import jax
    import jax.numpy as jnp

    x = jnp.ones((8192, 8192), dtype=jnp.float32)
    y = (x @ x).block_until_ready()
    stats = jax.devices()[0].memory_stats() or {}
    print(f"sum={float(y[0, 0]):.0f}")
    print(f"limit_mib={int(stats.get('bytes_limit', 0)) >> 20}")


def cupy_run():
    import cupy as cp

    a = cp.ones((256 << 20,), dtype=cp.float32)
    b = cp.ones((4096, 4096), dtype=cp.float32)
    c = b @ b
    free, total = cp.cuda.runtime.memGetInfo()
    print(f"sum={float(a.sum()) + float(c[0, 0]):.0f}")
    print(f"total_mib={total >> 20}")


def main():
    fw = sys.argv[1] if len(sys.argv) > 1 else ""
    runs = {"jax": jax_run, "cupy": cupy_run}
    if fw not in runs:
        print(__doc__, file=sys.stderr)
        return 64
    try:
        runs[fw]()
    except Exception as e:  # the row reports what failed, the harness goes on
        print(f"{fw}=error:{type(e).__name__}")
        print(f"error={str(e)[:200]!r}")
        return 0
    print(f"{fw}=ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
