//! The latency histogram's counts and the exposition's text.

use std::time::Duration;

use super::*;

#[test]
fn histogram_quantiles() {
    let h = LatencyHistogram::default();
    for us in [10, 20, 30, 150, 3_000] {
        h.record(Duration::from_micros(us), true);
    }
    h.record(Duration::from_secs(5), false);
    let s = h.snapshot();
    assert_eq!(s.count, 6);
    assert_eq!(s.timeouts, 1);
    assert_eq!(s.quantile_bound_us(0.5), Some(50));
    assert_eq!(s.quantile_bound_us(0.66), Some(200));
    assert_eq!(s.quantile_bound_us(1.0), Some(u64::MAX));
}

#[test]
fn gpu_health_gauge() {
    use hypervisor_observer::{Fault, GpuObserver, SimulatedGpus};
    let gpus = SimulatedGpus::new(2).gpus().unwrap();
    let lost = Unhealthy {
        fault: Fault::Lost,
        since: 0,
    };
    let text = render_health(&gpus, &BTreeMap::from([(gpus[1].uuid.clone(), lost)]));
    assert!(text.contains("# TYPE gpushare_gpu_healthy gauge"));
    assert!(text.contains(&format!(
        "gpushare_gpu_healthy{{gpu=\"{}\",index=\"0\"}} 1",
        gpus[0].uuid
    )));
    assert!(text.contains(&format!(
        "gpushare_gpu_healthy{{gpu=\"{}\",index=\"1\"}} 0",
        gpus[1].uuid
    )));
}

#[test]
fn turns_gpus_have_their_turn_and_handovers() {
    let text = render(&crate::status::tests::with_turns("trainer"));
    for sample in [
        "gpushare_gpu_turn_seconds{gpu=\"GPU-0\"} 0.005",
        "gpushare_gpu_turn_wanting_pods{gpu=\"GPU-0\"} 2",
        "gpushare_gpu_turn_handovers_total{gpu=\"GPU-0\"} 41",
    ] {
        assert!(text.lines().any(|line| line == sample), "{sample}: {text}");
    }
    assert!(!text.contains("{gpu=\"GPU-1\"}"), "{text}");
}

#[test]
fn label_values_are_escaped() {
    assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
}

#[test]
fn the_resident_set_swaps_by_cause_and_waits_by_cause_are_exposed() {
    use hypervisor_swap::{Direction, ResidentPod, ServingBoard, SwapCause, WaitCause};
    let board = ServingBoard::default();
    board.swapped("a", Direction::Out, SwapCause::Ahead);
    board.swapped("b", Direction::In, SwapCause::Demand);
    board.waited(WaitCause::SwapIn, Duration::from_millis(300));
    let resident = BTreeMap::from([(
        "gpu-0".to_owned(),
        vec![
            ResidentPod {
                pod: "b".into(),
                bytes: 3,
            },
            ResidentPod {
                pod: "c".into(),
                bytes: 4,
            },
        ],
    )]);
    let mut x = Exposition::default();
    serving::render(&mut x, &board.report(resident, vec!["d".into()]));
    let text = x.render();
    for sample in [
        "gpushare_gpu_resident_pods{gpu=\"gpu-0\"} 2",
        "gpushare_gpu_resident_bytes{gpu=\"gpu-0\"} 7",
        "gpushare_swap_waiting_pods 1",
        "gpushare_swap_causes_total{direction=\"out\",cause=\"ahead\"} 1",
        "gpushare_swap_causes_total{direction=\"out\",cause=\"demand\"} 0",
        "gpushare_swap_causes_total{direction=\"in\",cause=\"demand\"} 1",
        "gpushare_swap_wait_seconds_bucket{cause=\"swap_in\",le=\"0.25\"} 0",
        "gpushare_swap_wait_seconds_bucket{cause=\"swap_in\",le=\"0.5\"} 1",
        "gpushare_swap_wait_seconds_bucket{cause=\"swap_in\",le=\"+Inf\"} 1",
        "gpushare_swap_wait_seconds_count{cause=\"swap_in\"} 1",
    ] {
        assert!(text.lines().any(|line| line == sample), "{sample}: {text}");
    }
    assert!(
        !text.contains("cause=\"queue\""),
        "no wait of that cause: {text}"
    );
}
