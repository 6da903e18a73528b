//! Oversubscription under the hypervisor: a pod's spill cap reaches its
//! read-only limits, and what its processes spill shows in the status, the
//! table and the metrics, apart from device memory.

use crate::common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
#[test]
fn oversubscription_reaches_the_limits_and_the_spill_shows_in_status_and_metrics() {
    let a = unique("spill");
    let gpus = ["index = 0\nmemory = \"4g\"\nspill_limit = \"3g\""];
    let h = Harness::start(&pod_toml(&a, &gpus), 1, &[&a]);
    // This process is one of the pod's, and spills 1 GiB as a limiter would.
    let region = RegionView::open(&a);
    let cap = || {
        region
            .1
            .find(&gpu(0))
            .map(|limits| limits.spill_limit.load(Ordering::Acquire))
    };
    assert!(wait_for(Duration::from_secs(5), || cap() == Some(3 << 30)));
    region
        .0
        .try_spill_under(region.entry(0), 1 << 30, 3 << 30)
        .expect("spill");
    let gpu_status = || h.first_gpu_status(&a);
    let seen = gpu_status();
    let spill = (seen.spill_used, seen.spill_peak, seen.spill_limit);
    assert_eq!(spill, (1 << 30, 1 << 30, 3 << 30), "{seen:?}");
    assert_eq!(seen.memory_used, 0, "the spill is no device memory");
    let (_, metrics) = call("GET", &format!("{}/metrics", h.url()), None, None);
    let labels = format!("{{pod=\"{a}\",gpu=\"{}\"}}", gpu(0));
    for want in [
        format!("gpushare_pod_spill_bytes{labels} 1073741824"),
        format!("gpushare_pod_spill_peak_bytes{labels} 1073741824"),
        format!("gpushare_pod_spill_limit_bytes{labels} 3221225472"),
    ] {
        assert!(metrics.contains(&want), "missing {want} in\n{metrics}");
    }
    let table = hypervisor::status_table::render_table(&h.hv.hypervisor().status());
    assert!(
        table.contains("SPILL") && table.contains("3.0 GiB"),
        "{table}"
    );
    // Given back: nothing spilled now, the peak stays.
    region
        .0
        .release_spill(region.entry(0), 1 << 30)
        .expect("release");
    let seen = gpu_status();
    assert_eq!((seen.spill_used, seen.spill_peak), (0, 1 << 30), "{seen:?}");
}
