//! Where a pod's memory is has one book, its limits object: the status, the
//! metrics and the swap API show what it says the moment it says it, with
//! no swap of the daemon's behind it (its processes obey it, and a
//! restarted daemon finds it there). What the limits object cannot hold,
//! the bytes of a pod away in host memory, the sweep records.

use crate::common;

use common::*;
use gpushare_utils::ledger::PodLedger;
use gpushare_utils::limits::{PodLimits, Residency};
use gpushare_utils::shm::Creation;
use hypervisor_daemon::Hypervisor;
use system_tests::wait::eventually;

/// Bytes the pod's ledger holds while it is away.
const HELD: u64 = 256 << 20;

fn config(pod: &str) -> String {
    format!(
        "admin_token = \"{ADMIN}\"\n{}",
        pod_toml(pod, &["index = 0\nmemory = \"1g\""])
    )
}

/// Where the status says `pod` is: resident where it lists it not.
fn shown(hv: &Hypervisor, pod: &str) -> Residency {
    hv.status()
        .swap
        .pods
        .get(pod)
        .map_or(Residency::Resident, |p| p.state)
}

/// The metrics' count of pods away, and `pod`'s line of bytes in host
/// memory, with its state.
fn metrics(url: &str, pod: &str) -> (String, String) {
    let (status, text) = call("GET", &format!("{url}/metrics"), None, None);
    assert_eq!(status, 200, "{text}");
    let line = |prefix: &str| {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_default()
            .to_owned()
    };
    (
        line("gpushare_swapped_pods "),
        line(&format!("gpushare_pod_swap_host_bytes{{pod=\"{pod}\"")),
    )
}

#[test]
fn the_status_and_metrics_show_the_residency_the_limits_object_holds() {
    let pod = unique("residency");
    let h = Harness::start(&config(&pod), 1, &[&pod]);
    let hv = h.hv.hypervisor();
    let ledger = PodLedger::open(&pod).expect("the pod's ledger");
    ledger.try_reserve(0, HELD).expect("within the quota");
    let limits = PodLimits::create_or_adopt(&pod, &Creation::default()).expect("the pod's limits");

    // Written in the limits object alone, as an earlier run of the daemon
    // leaves it: shown at once, with no swap of this daemon's.
    limits.set_residency(Residency::Swapped);
    assert_eq!(shown(hv, &pod), Residency::Swapped);
    assert_eq!(hv.status().swap.totals.swapped_pods, 1);
    let (count, line) = metrics(&h.url(), &pod);
    assert_eq!(count, "gpushare_swapped_pods 1");
    assert!(line.contains("state=\"swapped\""), "{line}");
    let (status, body) = call(
        "GET",
        &format!("{}/api/v1/status", h.url()),
        Some(ADMIN),
        None,
    );
    assert_eq!(status, 200, "{body}");
    let json: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(json["swap"]["pods"][&pod]["state"], "swapped", "{body}");
    // The swap API answers from it too: nothing to swap out.
    let (status, body) = call(
        "POST",
        &format!("{}/api/v1/pods/{pod}/swap-out", h.url()),
        Some(ADMIN),
        None,
    );
    assert_eq!(
        (status, body.contains("\"residency\":\"swapped\"")),
        (200, true),
        "{body}"
    );

    // The sweep counts what the pod holds, by its ledger, in host memory.
    eventually("the pod's bytes are counted in host memory", || {
        hv.status().swap.totals.bytes_on_host == HELD
    });

    // Back in the limits object alone: resident at once, and nothing of it
    // in host memory, whatever the board last saw.
    limits.set_residency(Residency::Resident);
    let status = hv.status();
    assert_eq!(shown(hv, &pod), Residency::Resident);
    assert_eq!(
        (
            status.swap.totals.swapped_pods,
            status.swap.totals.bytes_on_host
        ),
        (0, 0),
        "{status:?}"
    );
    assert_eq!(hv.pod_swap(&pod).state, Residency::Resident);
    let (count, line) = metrics(&h.url(), &pod);
    assert_eq!(count, "gpushare_swapped_pods 0");
    assert!(
        line.contains("state=\"resident\"") && line.ends_with(" 0"),
        "{line}"
    );
}

#[test]
fn a_restarted_daemon_shows_a_pod_left_away_at_once_and_counts_its_bytes() {
    let pod = unique("residency-restart");
    let Harness {
        hv,
        sim,
        config: file,
        regions,
    } = Harness::start(&config(&pod), 1, &[&pod]);
    let ledger = PodLedger::open(&pod).expect("the pod's ledger");
    ledger.try_reserve(0, HELD).expect("within the quota");
    let limits = PodLimits::create_or_adopt(&pod, &Creation::default()).expect("the pod's limits");
    // A swap-in the daemon died in the middle of.
    limits.set_residency(Residency::SwappingIn);
    hv.stop();

    let again = start_hypervisor(&file.path, sim);
    let shown_now = shown(again.hypervisor(), &pod);
    assert_ne!(shown_now, Residency::Resident, "away from the start");
    // The sweep settles it swapped, for its next swap-in to finish, and
    // counts its bytes in host memory.
    eventually("the pod is shown swapped with its bytes", || {
        let swap = again.hypervisor().status().swap;
        swap.pods
            .get(&pod)
            .is_some_and(|p| p.state == Residency::Swapped && p.history.bytes_on_host == HELD)
            && swap.totals.bytes_on_host == HELD
    });
    assert_eq!(limits.residency(), Residency::Swapped);
    again.stop();
    drop(regions);
}
