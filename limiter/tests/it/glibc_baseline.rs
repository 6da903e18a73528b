//! The shipped limiter is built against glibc 2.17 (`scripts/build-limiter.sh`:
//! cargo-zigbuild with zig from PyPI) so that it loads in old workload images;
//! that build must load and enforce a quota as the native one does, here
//! against the driver double. `scripts/test.sh` installs the tools it needs.

use crate::common;

use std::path::Path;

use common::{CONTEXT_BYTES, GIB, Pod, info, probe, result_of, run};

#[test]
fn the_glibc_2_17_build_loads_and_enforces_the_quota() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace");
    let built = system_tests::tools::command("bash")
        .arg("scripts/build-limiter.sh")
        .current_dir(root)
        .output()
        .expect("run scripts/build-limiter.sh");
    assert!(
        built.status.success(),
        "scripts/build-limiter.sh failed (it needs cargo-zigbuild and zig, which scripts/test.sh installs):\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let stdout = String::from_utf8_lossy(&built.stdout);
    let library = root.join(stdout.lines().last().expect("the script prints the path"));
    assert!(library.is_file(), "no {}", library.display());
    let library = library.to_string_lossy().into_owned();
    let pod = Pod::new("glibc-baseline");
    let lines = run(probe(
        "cudaprobe",
        &pod,
        &[
            ("LD_PRELOAD", library.as_str()),
            ("CUDA_DEVICE_MEMORY_LIMIT", "4g"),
        ],
        &["info", "alloc", "mem", "3g", "alloc", "mem", "2g"],
    ));
    assert_eq!(
        lines[0],
        info(0, 4 * GIB - CONTEXT_BYTES, 4 * GIB),
        "{lines:?}"
    );
    assert_eq!(result_of(&lines[1]), 0, "{lines:?}");
    assert_eq!(result_of(&lines[2]), 2, "past the quota: {lines:?}");
}
