//! The provisioner's own count of each GPU: the last guard when a
//! scheduler's count and the node's disagree (a second scheduler, claims
//! from before a restart), which the official scheduler never lets happen;
//! with overcommit, the GPU's memory times the ratio for all pods, and never
//! more than the GPU's memory for one.

use std::path::{Path, PathBuf};

use super::*;
use hypervisor_config::MemoryCapacity;
use hypervisor_core::node_tables::NodeTableNames;

/// A folder of the test's own, removed when dropped.
fn scratch(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("provision-{tag}"))
        .tempdir()
        .unwrap()
}

fn provisioner(dir: &Path) -> Provisioner {
    let config = ProvisionConfig {
        state_dir: dir.join("state"),
        host_state_dir: dir.join("state"),
        cdi_dir: dir.join("cdi"),
        region_dir: dir.join("shm"),
        host_region_dir: dir.join("shm"),
        host_limiter: dir.join("libcuda_limiter.so"),
        hypervisor_url: "http://127.0.0.1:1".into(),
        host_socket_dir: None,
        cdi_vendor: "gpushare.dev".into(),
        cdi_class: "gpu".into(),
        host_root: PathBuf::from("/"),
        corun: None,
        node_tables: NodeTableNames {
            activity: "unused-activity".into(),
            priority: "unused-priority".into(),
        },
    };
    let gpu = GpuInfo {
        index: 0,
        uuid: "GPU-0".into(),
        name: "test".into(),
        memory_total: 16 << 30,
        memory_used: 0,
    };
    Provisioner::open(config, vec![gpu]).unwrap()
}

/// A claim `n` of its own pod, one share of GPU 0 per entry of `shares`
/// (memory bytes, compute percent).
fn claim(n: u8, shares: &[(u64, u8)]) -> ClaimRequest {
    let uid = |kind: u8| format!("00000000-0000-4000-8000-0000000000{kind}{n}");
    ClaimRequest {
        claim_uid: uid(1),
        namespace: "default".into(),
        name: format!("claim-{n}"),
        pod: PodRef {
            uid: uid(2),
            namespace: "default".into(),
            name: format!("pod-{n}"),
        },
        devices: shares
            .iter()
            .map(|&(memory_bytes, compute)| DeviceGrant {
                memory_bytes,
                ..DeviceGrant::example(compute, SharingParams::default())
            })
            .collect(),
    }
}

#[test]
fn a_claim_past_what_the_prepared_claims_leave_is_refused() {
    let scratch = scratch("capacity");
    let mut provisioner = provisioner(scratch.path());
    provisioner.prepare(claim(1, &[(4 << 30, 30)])).unwrap();
    provisioner.prepare(claim(2, &[(8 << 30, 60)])).unwrap();
    // 30 + 60 + 20 > 100.
    let error = provisioner.prepare(claim(3, &[(1 << 30, 20)])).unwrap_err();
    assert_eq!(
        error.to_string(),
        "GPU GPU-0: compute 20 asked, but only 10 of 100 is left by the claims already prepared"
    );
    // 4 + 8 + 5 GiB > 16 GiB.
    let error = provisioner.prepare(claim(4, &[(5 << 30, 5)])).unwrap_err();
    assert!(
        matches!(error, ProvisionError::OverCapacity { what: "memory", .. }),
        "{error}"
    );
    // Nothing of the refused claims was written.
    for n in [3, 4] {
        let uid = claim(n, &[]).claim_uid;
        assert!(
            !scratch
                .path()
                .join(format!("cdi/gpushare.dev-gpu_{uid}.json"))
                .exists()
        );
    }
}

#[test]
fn two_shares_of_one_gpu_in_one_claim_are_counted_together() {
    let scratch = scratch("twice");
    let mut provisioner = provisioner(scratch.path());
    // 2 x 60%: each fits alone, not together.
    let error = provisioner
        .prepare(claim(1, &[(1 << 30, 60), (1 << 30, 60)]))
        .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("compute 60 asked, but only 40 of 100"),
        "{error}"
    );
    // 2 x 40% fit.
    provisioner
        .prepare(claim(2, &[(1 << 30, 40), (1 << 30, 40)]))
        .unwrap();
}

/// Overcommit `ratio` on GPU 0 (`[swap] overcommit = [0]`).
fn overcommit(ratio: f64) -> MemoryCapacity {
    let ratio = hypervisor_config::OvercommitRatio::new(ratio).unwrap();
    MemoryCapacity::new(Some(vec![0]), ratio)
}

#[test]
fn an_overcommitting_gpu_takes_quotas_up_to_its_memory_times_the_ratio() {
    const GIB: u64 = 1 << 30;
    let scratch = scratch("overcommit");
    let mut provisioner = provisioner(scratch.path());
    // Without overcommit, two pods of 12 GiB do not fit a 16 GiB GPU.
    provisioner.prepare(claim(1, &[(12 * GIB, 10)])).unwrap();
    let error = provisioner
        .prepare(claim(2, &[(12 * GIB, 10)]))
        .unwrap_err();
    assert!(
        matches!(error, ProvisionError::OverCapacity { what: "memory", free, total, .. }
            if free == 4 * GIB && total == 16 * GIB),
        "{error}"
    );
    // At 1.5, the GPU offers 24 GiB: both fit, and nothing more.
    provisioner.set_memory_capacity(overcommit(1.5));
    let gpu = provisioner.gpus()[0].clone();
    assert_eq!(provisioner.memory_capacity(&gpu), 24 * GIB);
    provisioner.prepare(claim(2, &[(12 * GIB, 10)])).unwrap();
    assert_eq!(provisioner.held("GPU-0").0, 24 * GIB);
    let error = provisioner.prepare(claim(3, &[(1 << 28, 10)])).unwrap_err();
    assert_eq!(
        error.to_string(),
        format!(
            "GPU GPU-0: memory {} asked, but only 0 of {} is left by the claims already prepared",
            1 << 28,
            24 * GIB
        )
    );
    // The pods' quotas are what their claims say, each within the GPU.
    let quotas: Vec<u64> = provisioner
        .pod_specs()
        .unwrap()
        .iter()
        .map(|spec| spec.gpus[0].memory_bytes)
        .collect();
    assert_eq!(quotas, [12 * GIB, 12 * GIB]);
}

#[test]
fn no_pod_gets_more_of_a_gpu_than_its_memory_even_where_it_overcommits() {
    const GIB: u64 = 1 << 30;
    let scratch = scratch("past-the-gpu");
    let mut provisioner = provisioner(scratch.path());
    provisioner.set_memory_capacity(overcommit(2.0));
    provisioner.prepare(claim(1, &[(8 * GIB, 10)])).unwrap();
    // Two shares of one claim on the GPU: 20 GiB fits the 32 GiB offered,
    // not the 16 GiB one pod can ever have resident.
    let error = provisioner
        .prepare(claim(2, &[(10 * GIB, 10), (10 * GIB, 10)]))
        .unwrap_err();
    assert!(
        matches!(error, ProvisionError::PastTheGpu { asked, memory, .. }
            if asked == 20 * GIB && memory == 16 * GIB),
        "{error}"
    );
    // Two claims of one pod count together.
    let first = claim(3, &[(10 * GIB, 10)]);
    provisioner.prepare(first.clone()).unwrap();
    let mut second = claim(4, &[(10 * GIB, 10)]);
    second.pod = first.pod.clone();
    let error = provisioner.prepare(second.clone()).unwrap_err();
    assert_eq!(
        error.to_string(),
        format!(
            "GPU GPU-0: pod {} would hold {} bytes of it with this claim, more than its {} bytes of memory",
            first.pod,
            20 * GIB,
            16 * GIB
        )
    );
    // Nothing of the refused claims was written.
    for uid in [claim(2, &[]).claim_uid, second.claim_uid] {
        assert!(!provisioner.claims().contains_key(&uid));
        assert!(
            !scratch
                .path()
                .join(format!("cdi/gpushare.dev-gpu_{uid}.json"))
                .exists()
        );
    }
}
