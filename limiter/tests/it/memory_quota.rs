//! The limiter preloaded into programs that reach the driver double by direct
//! linking, by `dlopen`+`dlsym` and by `cuGetProcAddress`: quotas, OOM codes,
//! reports.

use crate::common;

use common::{CONTEXT_BYTES, GIB, MIB, Pod, VIAS, info, probe, result_of, run};

#[test]
fn quota_caps_allocations_whatever_the_path_to_the_driver() {
    for (program, via) in VIAS {
        let pod = Pod::new("paths");
        let script = [
            "info", "alloc", "mem", "3g", "alloc", "mem", "1g", "info", "free", "0", "alloc",
            "mem", "1g", "info",
        ];
        let args: Vec<&str> = via.iter().chain(script.iter()).copied().collect();
        let lines = run(probe(
            program,
            &pod,
            &[("CUDA_DEVICE_MEMORY_LIMIT", "4g")],
            &args,
        ));
        let quota = 4 * GIB;
        let context = CONTEXT_BYTES;
        assert_eq!(
            lines[0],
            info(0, quota - context, quota),
            "{program} {via:?}"
        );
        assert_eq!(result_of(&lines[1]), 0, "{program} {via:?}: {lines:?}");
        assert_eq!(result_of(&lines[2]), 2, "{program} {via:?}: {lines:?}");
        assert_eq!(lines[3], info(0, quota - context - 3 * GIB, quota));
        assert_eq!(result_of(&lines[4]), 0);
        assert_eq!(result_of(&lines[5]), 0);
        assert_eq!(lines[6], info(0, quota - context - GIB, quota));
    }
}

#[test]
fn every_allocation_api_counts_and_every_free_gives_back() {
    let apis = [
        "mem",
        "pitch",
        "managed",
        "async",
        "async_ptsz",
        "pool",
        "pool_ptsz",
        "create",
        "array",
        "array3d",
        "mipmap",
    ];
    for api in apis {
        for (program, via) in [VIAS[0], VIAS[2]] {
            let pod = Pod::new("apis");
            let script = [
                "alloc", api, "2g", "alloc", api, "2g", "info", "free", "0", "info",
            ];
            let args: Vec<&str> = via.iter().chain(script.iter()).copied().collect();
            let lines = run(probe(
                program,
                &pod,
                &[("CUDA_LIMITER_MEMORY_LIMIT", "4g")],
                &args,
            ));
            let quota = 4 * GIB;
            assert_eq!(result_of(&lines[0]), 0, "{api} via {program}: {lines:?}");
            assert_eq!(result_of(&lines[1]), 2, "{api} via {program}: {lines:?}");
            assert_eq!(
                lines[2],
                info(0, quota - CONTEXT_BYTES - 2 * GIB, quota),
                "{api} via {program}"
            );
            assert_eq!(result_of(&lines[3]), 0, "{api} via {program}: {lines:?}");
            assert_eq!(
                lines[4],
                info(0, quota - CONTEXT_BYTES, quota),
                "{api} via {program}"
            );
        }
    }
}

#[test]
fn reports_show_the_quota_in_every_api() {
    let pod = Pod::new("reports");
    let lines = run(probe(
        "cudaprobe_linked",
        &pod,
        &[("CUDA_DEVICE_MEMORY_LIMIT_0", "2g")],
        &[
            "totalmem",
            "totalmem_v1",
            "info_v1",
            "alloc",
            "mem",
            "512m",
            "nvml",
            "nvml_v2",
        ],
    ));
    let quota = 2 * GIB;
    assert_eq!(lines[0], format!("totalmem 0 {quota}"));
    assert_eq!(lines[1], format!("totalmem_v1 0 {quota}"));
    assert_eq!(
        lines[2],
        format!("info_v1 0 free={} total={quota}", quota - CONTEXT_BYTES)
    );
    let used = CONTEXT_BYTES + 512 * MIB;
    let free = quota - used;
    assert_eq!(
        lines[4],
        format!("nvml 0 free={free} used={used} total={quota}")
    );
    assert_eq!(
        lines[5],
        format!("nvml_v2 0 free={free} used={used} total={quota}")
    );
}

#[test]
fn reports_never_exceed_what_the_device_really_has() {
    let pod = Pod::new("small-device");
    let lines = run(probe(
        "cudaprobe_linked",
        &pod,
        &[
            ("CUDA_DEVICE_MEMORY_LIMIT", "4g"),
            ("GPUSHARE_DOUBLE_TOTAL", "2g"),
        ],
        &["info", "totalmem"],
    ));
    let real = 2 * GIB;
    assert_eq!(lines[0], info(0, real - CONTEXT_BYTES, real));
    assert_eq!(lines[1], format!("totalmem 0 {real}"));
}

#[test]
fn concurrent_threads_never_overshoot_and_end_at_zero() {
    let pod = Pod::new("threads");
    let lines = run(probe(
        "cudaprobe",
        &pod,
        &[("CUDA_DEVICE_MEMORY_LIMIT", "1g")],
        &["hammer", "8", "2000", "96m", "info"],
    ));
    let counts: Vec<u64> = lines[0]
        .split_whitespace()
        .skip(1)
        .map(|field| {
            field
                .split('=')
                .nth(1)
                .and_then(|n| n.parse().ok())
                .expect("count")
        })
        .collect();
    let [ok, oom, other] = counts[..] else {
        panic!("bad hammer line {:?}", lines[0]);
    };
    assert_eq!(ok + oom, 16_000, "{lines:?}");
    assert_eq!(other, 0, "{lines:?}");
    assert!(ok > 0, "{lines:?}");
    assert_eq!(lines[1], info(0, GIB - CONTEXT_BYTES, GIB));
}

#[test]
fn unlimited_device_and_unconfigured_process_see_the_real_driver() {
    let pod = Pod::new("off");
    // No limit at all: nothing is patched.
    let lines = run(probe(
        "cudaprobe_linked",
        &pod,
        &[],
        &["info", "alloc", "mem", "10g"],
    ));
    assert_eq!(lines[0], info(0, 16 * GIB - CONTEXT_BYTES, 16 * GIB));
    assert_eq!(result_of(&lines[1]), 0);
    // A limit on another device only.
    let lines = run(probe(
        "cudaprobe_linked",
        &pod,
        &[("CUDA_DEVICE_MEMORY_LIMIT_1", "1g")],
        &["info", "alloc", "mem", "10g"],
    ));
    assert_eq!(lines[0], info(0, 16 * GIB - CONTEXT_BYTES, 16 * GIB));
    assert_eq!(result_of(&lines[1]), 0);
}

#[test]
fn migrated_configurations_apply_by_index_and_uuid() {
    let uuid = gpushare_examples::uuid(0).to_uppercase();
    let tensor_fusion = format!("{{\"{uuid}\": {GIB}}}");
    let cases: [(&str, String); 4] = [
        ("CUDA_MEM_LIMIT_0", "1024m".to_owned()),
        ("TENSOR_FUSION_CUDA_MEM_LIMIT", tensor_fusion),
        ("TENSOR_FUSION_CUDA_MEM_LIMIT", format!("{{\"0\": {GIB}}}")),
        ("VCUDA_MEMORY_LIMIT", GIB.to_string()),
    ];
    for (variable, value) in cases {
        let pod = Pod::new("migrated");
        let lines = run(probe(
            "cudaprobe",
            &pod,
            &[(variable, value.as_str())],
            &["info"],
        ));
        assert_eq!(
            lines[0],
            info(0, GIB - CONTEXT_BYTES, GIB),
            "{variable}={value}"
        );
    }
}

#[test]
fn limits_that_name_other_gpus_by_uuid_leave_this_one_nothing() {
    // A mistyped or stale UUID must not leave the GPU unlimited: limits
    // that name GPUs only by UUID give one they do not name no memory, so
    // its context is refused.
    let other = gpushare_examples::uuid(7);
    let pod = Pod::new("other-uuid");
    let output = probe(
        "cudaprobe",
        &pod,
        &[(
            "TENSOR_FUSION_CUDA_MEM_LIMIT",
            &format!("{{\"{other}\": {GIB}}}"),
        )],
        &["info"],
    )
    .output()
    .expect("spawn");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "ran: {output:?}");
    assert!(
        stderr.contains("cuDevicePrimaryCtxRetain failed: 2")
            && stderr.contains("name GPUs by UUID, none of them this one"),
        "{stderr}"
    );
    // Named by index too, or by its own UUID: its limit applies as before.
    let lines = run(probe(
        "cudaprobe",
        &pod,
        &[(
            "TENSOR_FUSION_CUDA_MEM_LIMIT",
            &format!("{{\"{other}\": {GIB}, \"0\": {}}}", 2 * GIB),
        )],
        &["info"],
    ));
    assert_eq!(lines[0], info(0, 2 * GIB - CONTEXT_BYTES, 2 * GIB));
}

#[test]
fn a_map_naming_one_gpu_by_index_and_by_uuid_refuses_cuda() {
    // Which key wins is no answer: {"0": 1 GiB, "GPU-…": 0} would run GPU 0
    // unlimited where its writer may have meant a quota.
    let uuid = gpushare_examples::uuid(0).to_uppercase();
    let pod = Pod::new("named-twice");
    for (variable, value) in [
        (
            "TENSOR_FUSION_CUDA_MEM_LIMIT",
            format!("{{\"0\": {GIB}, \"{uuid}\": 0}}"),
        ),
        (
            "TENSOR_FUSION_CUDA_UP_LIMIT",
            format!("{{\"{uuid}\": 30, \"0\": 0}}"),
        ),
    ] {
        let output = probe("cudaprobe", &pod, &[(variable, value.as_str())], &["info"])
            .output()
            .expect("spawn");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{variable}: ran: {output:?}");
        assert!(
            stderr.contains("cuInit failed: 3")
                && stderr.contains(&format!(
                    "cuda-limiter: configuration error: {variable} names one device twice"
                )),
            "{variable}: {stderr}"
        );
    }
    // The same map on a process that sees another GPU as device 0 names
    // each of its devices once.
    let other = gpushare_examples::uuid(1);
    let lines = run(probe(
        "cudaprobe",
        &pod,
        &[(
            "TENSOR_FUSION_CUDA_MEM_LIMIT",
            &format!("{{\"0\": {GIB}, \"{other}\": 0}}"),
        )],
        &["info"],
    ));
    assert_eq!(lines[0], info(0, GIB - CONTEXT_BYTES, GIB));
}

#[test]
fn malformed_configuration_is_one_clear_line_and_cuda_is_refused() {
    let pod = Pod::new("broken");
    let output = probe(
        "cudaprobe",
        &pod,
        &[("CUDA_DEVICE_MEMORY_LIMIT_0", "4x")],
        &["info"],
    )
    .output()
    .expect("spawn");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "ran anyway: {stderr}");
    let first = stderr.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("cuda-limiter: configuration error: ")
            && first.contains("CUDA_DEVICE_MEMORY_LIMIT_0")
            && first.contains("4x"),
        "{stderr}"
    );
    assert_eq!(
        stderr
            .lines()
            .filter(|line| line.starts_with("cuda-limiter:"))
            .count(),
        1,
        "said once: {stderr}"
    );
    // A process that never touches CUDA still runs, and is not the one to
    // say what is wrong (every process of a container loads the library).
    let output = std::process::Command::new("sh")
        .args(["-c", "exit 0"])
        .env("LD_PRELOAD", common::limiter())
        .env("CUDA_DEVICE_MEMORY_LIMIT_0", "4x")
        .output()
        .expect("spawn sh");
    assert!(output.status.success());
    assert!(output.stderr.is_empty(), "{output:?}");
}
