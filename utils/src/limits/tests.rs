//! Tests of the limits object.

use super::*;

#[test]
fn a_residency_reads_back_from_its_code_and_its_name() {
    for residency in [
        Residency::Resident,
        Residency::SwappingOut,
        Residency::Swapped,
        Residency::SwappingIn,
    ] {
        assert_eq!(Residency::from_code(residency.code()), residency);
        let json = serde_json::to_string(&residency).expect("encode");
        assert_eq!(json, format!("\"{}\"", residency.as_str()));
    }
    assert_eq!(
        Residency::from_code(77),
        Residency::Swapped,
        "unknown: not resident"
    );
}

struct Cleanup(String);
impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = shm::unlink(&PodLimits::name_of(&self.0));
    }
}

#[test]
fn the_default_spill_cap_is_a_share_of_the_node_memory() {
    let meminfo = "MemTotal:       131072000 kB\nMemFree:        1 kB\n";
    assert_eq!(mem_total(meminfo), Some(131_072_000 * 1024));
    assert_eq!(mem_total("MemFree: 1 kB\n"), None);
    assert!(
        default_spill_limit() > 0,
        "this machine has a /proc/meminfo"
    );
}

#[test]
fn keys_ignore_case_and_never_zero() {
    assert_eq!(uuid_key("GPU-ABC"), uuid_key("gpu-abc"));
    assert_ne!(uuid_key("GPU-a"), uuid_key("GPU-b"));
    assert_ne!(uuid_key(""), 0);
}

#[test]
fn written_limits_are_read_back_read_only() {
    let pod = format!("limits-test-{}", std::process::id());
    let _cleanup = Cleanup(pod.clone());
    let writer = PodLimits::create_or_adopt(&pod, &Creation::default()).unwrap();
    assert!(matches!(
        PodLimits::open_read_only(&pod, &Trust::own_or_root(None)),
        Err(LimitsError::NotPublished { .. })
    ));
    writer.set("GPU-1", 1 << 30).unwrap();
    let gpu2 = writer.set("GPU-2", 0).unwrap();
    gpu2.compute.configure(25, 25);
    gpu2.set_class(PodClass::Latency);
    writer.publish();
    let reader = PodLimits::open_read_only(&pod, &Trust::own_or_root(None)).unwrap();
    assert_eq!(
        reader.find("gpu-1").unwrap().quota.load(Ordering::Relaxed),
        1 << 30
    );
    assert_eq!(
        reader
            .find("GPU-2")
            .unwrap()
            .compute
            .rate_ppm
            .load(Ordering::Relaxed),
        250_000
    );
    assert_eq!(reader.find("GPU-2").unwrap().class(), PodClass::Latency);
    assert_eq!(reader.find("GPU-1").unwrap().class(), PodClass::Batch);
    assert!(reader.find("GPU-3").is_none());
    // The next MPS client's share of the SMs: the smallest given.
    assert_eq!(reader.sm_percent(), None);
    writer.find("GPU-1").unwrap().set_sm_percent(80);
    writer.find("GPU-2").unwrap().set_sm_percent(100);
    assert_eq!(reader.find("GPU-2").unwrap().sm_percent(), Some(100));
    assert_eq!(reader.sm_percent(), Some(80));
    writer.retain(&["GPU-2"]);
    assert!(reader.find("GPU-1").is_none());
    assert_eq!(reader.sm_percent(), Some(100));
    writer.find("GPU-2").unwrap().set_sm_percent(0);
    assert_eq!(reader.sm_percent(), None);
    // A second hypervisor run adopts its own object.
    let again = PodLimits::create_or_adopt(&pod, &Creation::default()).unwrap();
    assert!(again.find("GPU-2").is_some());
}

#[test]
fn limits_moved_to_another_gpu_keep_their_entry_and_remember_the_first() {
    let pod = format!("limits-moved-{}", std::process::id());
    let _cleanup = Cleanup(pod.clone());
    let writer = PodLimits::create_or_adopt(&pod, &Creation::default()).unwrap();
    let first = writer.set("GPU-a", 3 << 30).unwrap();
    first.compute.configure(40, 60);
    writer.set("GPU-c", 1 << 30).unwrap();
    writer.publish();
    let reader = PodLimits::open_read_only(&pod, &Trust::own_or_root(None)).unwrap();
    let before = std::ptr::from_ref(reader.find("GPU-a").unwrap());

    writer.relocate("GPU-A", "GPU-b").unwrap();
    assert!(reader.find("GPU-a").is_none());
    let moved = reader.find("GPU-b").unwrap();
    assert!(
        std::ptr::eq(before, moved),
        "the same entry, under its new key"
    );
    assert_eq!(moved.quota.load(Ordering::Relaxed), 3 << 30);
    assert_eq!(moved.compute.rate_ppm.load(Ordering::Relaxed), 400_000);
    assert_eq!(
        writer.relocations(),
        vec![(uuid_key("GPU-a"), uuid_key("GPU-b"))]
    );

    // Onward: still placed as the first GPU; back there: not moved.
    writer.relocate("GPU-b", "GPU-d").unwrap();
    assert_eq!(
        writer.relocations(),
        vec![(uuid_key("GPU-a"), uuid_key("GPU-d"))]
    );
    writer.relocate("GPU-d", "GPU-a").unwrap();
    assert!(writer.relocations().is_empty());

    // Nothing on the source, or limits on the target already: refused.
    assert!(matches!(
        writer.relocate("GPU-x", "GPU-y"),
        Err(LimitsError::Relocation { .. })
    ));
    assert!(matches!(
        writer.relocate("GPU-a", "GPU-c"),
        Err(LimitsError::Relocation { .. })
    ));
    // A GPU forgotten forgets where it came from.
    writer.relocate("GPU-a", "GPU-b").unwrap();
    writer.retain(&["GPU-c"]);
    assert!(writer.relocations().is_empty());
}

#[test]
fn demand_seen_is_kept_per_gpu_entry() {
    let pod = format!("limits-demand-{}", std::process::id());
    let _cleanup = Cleanup(pod.clone());
    let writer = PodLimits::create_or_adopt(&pod, &Creation::default()).unwrap();
    writer.set("GPU-a", 0).unwrap();
    writer.set("GPU-b", 0).unwrap();
    writer.publish();
    let reader = PodLimits::open_read_only(&pod, &Trust::own_or_root(None)).unwrap();
    assert!(!reader.demand_seen("GPU-a"), "zero: ask");
    assert!(writer.set_demand_seen("gpu-B", true));
    assert!(reader.demand_seen("GPU-b") && !reader.demand_seen("GPU-a"));
    assert!(writer.set_demand_seen("GPU-a", true));
    assert!(writer.set_demand_seen("GPU-b", false));
    assert!(reader.demand_seen("GPU-a") && !reader.demand_seen("GPU-b"));
    assert!(!writer.set_demand_seen("GPU-z", true), "no such GPU");
    assert!(!reader.demand_seen("GPU-z"));
    // A moved entry keeps its bit; a forgotten one loses it, so the GPU
    // that takes the entry next starts by asking.
    writer.relocate("GPU-a", "GPU-c").unwrap();
    assert!(reader.demand_seen("GPU-c"));
    writer.retain(&["GPU-b"]);
    writer.set("GPU-d", 0).unwrap();
    assert!(!reader.demand_seen("GPU-d"));
}

#[test]
fn a_pending_move_is_kept_until_cleared() {
    let pod = format!("limits-pending-{}", std::process::id());
    let _cleanup = Cleanup(pod.clone());
    let writer = PodLimits::create_or_adopt(&pod, &Creation::default()).unwrap();
    assert_eq!(writer.pending_move(), None);
    writer.set_pending_move(Some(("GPU-A", "gpu-b")));
    // A second hypervisor run adopts the object, and finds the move.
    let again = PodLimits::create_or_adopt(&pod, &Creation::default()).unwrap();
    assert_eq!(
        again.pending_move(),
        Some((uuid_key("gpu-a"), uuid_key("GPU-B")))
    );
    again.set_pending_move(None);
    assert_eq!(writer.pending_move(), None);
}

#[test]
fn an_object_of_an_untrusted_owner_is_refused() {
    let pod = format!("limits-untrusted-{}", std::process::id());
    let _cleanup = Cleanup(pod.clone());
    let writer = PodLimits::create_or_adopt(&pod, &Creation::default()).unwrap();
    writer.publish();
    let nobody = Trust::only(&[shm::effective_uid().wrapping_add(1)]);
    assert!(matches!(
        PodLimits::open_read_only(&pod, &nobody),
        Err(LimitsError::Shm(ShmError::UntrustedOwner { .. }))
    ));
}
