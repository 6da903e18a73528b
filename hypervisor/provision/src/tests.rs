//! The provisioner's own count of each GPU: the last guard when a
//! scheduler's count and the node's disagree (a second scheduler, claims
//! from before a restart), which the official scheduler never lets happen.

use std::path::{Path, PathBuf};

use super::*;
use hypervisor_core::node_tables::NodeTableNames;

/// A folder of its own, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("provision-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
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
    let scratch = Scratch::new("capacity");
    let mut provisioner = provisioner(&scratch.0);
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
                .0
                .join(format!("cdi/gpushare.dev-gpu_{uid}.json"))
                .exists()
        );
    }
}

#[test]
fn two_shares_of_one_gpu_in_one_claim_are_counted_together() {
    let scratch = Scratch::new("twice");
    let mut provisioner = provisioner(&scratch.0);
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
