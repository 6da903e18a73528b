"""The workspace's builds the selftests drive where they exist: the daemon,
the limiter, the fake MPS control daemon. GPUSHARE_SELFTEST_TARGET names
the build folder (<target>/<profile>) of the system test that runs these
tests with everything built: there a missing build is an error, not a
skipped test. Else target/release or target/debug, if built."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def built(name: str) -> Path | None:
    """The build of `name`, or None where nothing names a folder and
    target/ lacks it."""
    named = os.environ.get("GPUSHARE_SELFTEST_TARGET")
    if named:
        path = Path(named) / name
        if not path.is_file():
            raise FileNotFoundError(f"GPUSHARE_SELFTEST_TARGET={named} has no {name}")
        return path
    for kind in ("release", "debug"):
        path = REPO / "target" / kind / name
        if path.is_file():
            return path
    return None


def double_dir() -> Path | None:
    """The folder of the driver double's libcuda.so.1 (the build of the
    gpushare-examples crate) beside the builds above, the newest where
    several builds left one; None where there is none."""
    named = os.environ.get("GPUSHARE_SELFTEST_TARGET")
    folders = [Path(named)] if named else [REPO / "target" / kind for kind in ("release", "debug")]
    for folder in folders:
        found = sorted(folder.glob("build/gpushare-examples-*/out/double/libcuda.so.1"),
                       key=lambda p: p.stat().st_mtime)
        if found:
            return found[-1].parent
    return None
