//! How the node serves its swapped pods, in the exposition: the resident
//! set of each GPU, the pods waiting for room, swaps by cause and waits by
//! cause.

use hypervisor_swap::serving::WAIT_BOUNDS_S;
use hypervisor_swap::{Direction, ServingReport, SwapCause};

use super::{Exposition, escape};

/// Adds the serving families of `serving` to `x`.
pub(super) fn render(x: &mut Exposition, serving: &ServingReport) {
    let pods = x.family(
        "gpushare_gpu_resident_pods",
        "gauge",
        "Pods on the GPU now (not swapped out), the resident set.",
    );
    let bytes = x.family(
        "gpushare_gpu_resident_bytes",
        "gauge",
        "Bytes the resident set holds on the GPU, by the pods' ledgers.",
    );
    for (gpu, resident) in &serving.resident {
        let labels = format!("gpu=\"{}\"", escape(gpu));
        x.sample(pods, "", &labels, resident.len());
        x.sample(
            bytes,
            "",
            &labels,
            resident.iter().map(|p| p.bytes).sum::<u64>(),
        );
    }
    let waiting = x.family(
        "gpushare_swap_waiting_pods",
        "gauge",
        "Swapped pods whose swap-in waits for room, served in the order they asked.",
    );
    x.sample(waiting, "", "", serving.waiting.len());
    let causes = x.family(
        "gpushare_swap_causes_total",
        "counter",
        "Swaps done, by direction and cause (ahead: out to keep the GPU's headroom; demand: out for room, in at a trapped call; operator: asked by an operator or a drain).",
    );
    for direction in [Direction::Out, Direction::In] {
        for cause in [SwapCause::Ahead, SwapCause::Demand, SwapCause::Operator] {
            if direction == Direction::In && cause == SwapCause::Ahead {
                continue;
            }
            let labels = format!(
                "direction=\"{}\",cause=\"{}\"",
                direction.as_str(),
                cause.as_str()
            );
            x.sample(causes, "", &labels, serving.swaps_of(direction, cause));
        }
    }
    let waits = x.family(
        "gpushare_swap_wait_seconds",
        "histogram",
        "Waits by cause: a swap-in behind other swaps (queue), for the swap-outs that made its room (swap_out), for its own restore (swap_in); an allocation for its room, or a swap-in refused for want of room from its first ask until back (room).",
    );
    for (cause, recorded) in &serving.waits {
        let cause = cause.as_str();
        let mut cumulative = 0;
        for (at, n) in recorded.buckets.iter().enumerate() {
            cumulative += n;
            let le = WAIT_BOUNDS_S
                .get(at)
                .map_or("+Inf".to_owned(), f64::to_string);
            let labels = format!("cause=\"{cause}\",le=\"{le}\"");
            x.sample(waits, "_bucket", &labels, cumulative);
        }
        let labels = format!("cause=\"{cause}\"");
        x.sample(waits, "_sum", &labels, recorded.sum_s);
        x.sample(waits, "_count", &labels, recorded.count);
    }
}
