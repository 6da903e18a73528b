//! The table `hypervisor status` prints: the daemon's status (its
//! `GET /api/v1/status` JSON) for a reader at a terminal.

use std::fmt::Write as _;

use hypervisor_corun::MpsState;
use hypervisor_status::status::Status;

/// The status as a plain-text table.
pub fn render_table(status: &Status) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "hypervisor {} (instance {})",
        status.version, status.instance
    );
    let _ = writeln!(out, "\nGPUS");
    let _ = writeln!(
        out,
        "{:<5} {:<42} {:>12} {:>12}  NAME",
        "INDEX", "UUID", "MEM USED", "MEM TOTAL"
    );
    for gpu in &status.gpus {
        let _ = writeln!(
            out,
            "{:<5} {:<42} {:>12} {:>12}  {}",
            gpu.index,
            gpu.uuid,
            bytes(gpu.memory_used),
            bytes(gpu.memory_total),
            gpu.name
        );
    }
    let _ = writeln!(out, "\nPODS");
    let _ = writeln!(
        out,
        "{:<20} {:<9} {:>7}  {:<42} {:>3} {:<7} {:>6} {:>5} {:>5} {:>12} {:>12} {:>8} {:>8} {:>8} {:>7}",
        "POD",
        "STATE",
        "WORKERS",
        "GPU",
        "IDX",
        "POLICY",
        "WEIGHT",
        "CAP",
        "SHARE",
        "MEM USED",
        "MEM QUOTA",
        "GRANTED",
        "ACHIEVED",
        "CEILING",
        "WAITING"
    );
    for pod in &status.pods {
        let state = if pod.suspended {
            "suspended"
        } else {
            "running"
        };
        if pod.gpus.is_empty() {
            let _ = writeln!(out, "{:<20} {:<9} {:>7}  -", pod.id, state, pod.workers);
        }
        for gpu in &pod.gpus {
            let _ = writeln!(
                out,
                "{:<20} {:<9} {:>7}  {:<42} {:>3} {:<7} {:>6} {:>5} {:>5} {:>12} {:>12} {:>8} {:>8} {:>8} {:>7}",
                pod.id,
                state,
                pod.workers,
                gpu.uuid.as_deref().unwrap_or(&gpu.gpu),
                gpu.host_index.map_or("-".to_owned(), |o| o.to_string()),
                gpu.policy,
                gpu.weight,
                gpu.cap_percent.map_or("-".to_owned(), |c| format!("{c}%")),
                gpu.share_percent
                    .map_or("-".to_owned(), |s| format!("{s}%")),
                bytes(gpu.memory_used),
                if gpu.memory_quota == 0 {
                    "unlimited".to_owned()
                } else {
                    bytes(gpu.memory_quota)
                },
                share(gpu.rate_ppm),
                percent(gpu.achieved_ppm),
                share(gpu.ceiling_ppm),
                gpu.waiting
            );
        }
    }
    render_spill(&mut out, status);
    render_priority(&mut out, status);
    render_corun(&mut out, status);
    render_turns(&mut out, status);
    render_serving(&mut out, status);
    let _ = writeln!(out, "\nWORKERS");
    let _ = writeln!(out, "{:<48} {:<20} {:>8}  LAST COMMAND", "ID", "POD", "PID");
    for w in &status.workers {
        let last = match (&w.last_command, w.last_ok) {
            (None, _) => "-".to_owned(),
            (Some(c), None) => format!("{c} (no answer)"),
            (Some(c), Some(true)) => format!("{c} (ok)"),
            (Some(c), Some(false)) => format!("{c} (failed)"),
        };
        let _ = writeln!(out, "{:<48} {:<20} {:>8}  {last}", w.id, w.pod, w.pid);
    }
    let a = &status.admission;
    let q = |p| {
        a.quantile_bound_us(p).map_or("-".to_owned(), |us| {
            if us == u64::MAX {
                ">1s".to_owned()
            } else {
                format!("≤{us}µs")
            }
        })
    };
    let _ = writeln!(
        out,
        "\nADMISSION  requests {}  timeouts {}  p50 {}  p99 {}",
        a.count,
        a.timeouts,
        q(0.5),
        q(0.99)
    );
    out
}

/// Once the node has swapped: each GPU's resident set, the swaps by cause
/// and the pods waiting for room, in order.
fn render_serving(out: &mut String, status: &Status) {
    let serving = &status.swap.serving;
    if serving.swaps.is_empty() && status.swap.totals.swapped_pods == 0 {
        return;
    }
    let _ = writeln!(out, "\nRESIDENT");
    for (gpu, pods) in &serving.resident {
        let pods: Vec<String> = pods
            .iter()
            .map(|p| format!("{} ({})", p.pod, bytes(p.bytes)))
            .collect();
        let _ = writeln!(out, "{gpu:<42} {}", pods.join(", "));
    }
    let swaps: Vec<String> = serving
        .swaps
        .iter()
        .map(|(k, n)| format!("{k} {n}"))
        .collect();
    let waiting = if serving.waiting.is_empty() {
        "-".to_owned()
    } else {
        serving.waiting.join(", ")
    };
    let _ = writeln!(
        out,
        "SWAPS  {}  waiting for room: {waiting}",
        swaps.join("  ")
    );
}

fn share(ppm: u32) -> String {
    if ppm == 0 {
        "unlimited".to_owned()
    } else {
        percent(ppm)
    }
}

fn percent(ppm: u32) -> String {
    format!("{:.1}%", f64::from(ppm) / 1e4)
}

fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// Pods' GPUs with oversubscription on (or host memory still spilled):
/// spilled now, peak and cap. Device memory stays in the table above.
fn render_spill(out: &mut String, status: &Status) {
    let rows: Vec<_> = status
        .pods
        .iter()
        .flat_map(|pod| pod.gpus.iter().map(move |gpu| (pod.id.as_str(), gpu)))
        .filter(|(_, gpu)| gpu.spill_limit > 0 || gpu.spill_used > 0)
        .collect();
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(out, "\nSPILL (host memory past the quota)");
    let _ = writeln!(
        out,
        "{:<20} {:<42} {:>12} {:>12} {:>12}",
        "POD", "GPU", "SPILLED", "PEAK", "CAP"
    );
    for (id, gpu) in rows {
        let _ = writeln!(
            out,
            "{:<20} {:<42} {:>12} {:>12} {:>12}",
            id,
            gpu.uuid.as_deref().unwrap_or(&gpu.gpu),
            bytes(gpu.spill_used),
            bytes(gpu.spill_peak),
            bytes(gpu.spill_limit)
        );
    }
}

/// Co-run GPUs: their MPS control daemon's state and restarts, and the
/// servers that failed.
fn render_corun(out: &mut String, status: &Status) {
    if status.corun.is_empty() {
        return;
    }
    let _ = writeln!(out, "\nCO-RUN (MPS)");
    let _ = writeln!(
        out,
        "{:<42} {:<8} {:>8} {:>8} {:>8}  DETAIL",
        "GPU", "STATE", "PID", "RESTARTS", "SRV-FAIL"
    );
    for gpu in &status.corun {
        let (state, detail) = match &gpu.state {
            MpsState::Starting => ("starting", String::new()),
            MpsState::Up { since } => ("up", format!("since {since}")),
            MpsState::Down { reason, since } => ("down", format!("since {since}: {reason}")),
            MpsState::Stopped => ("stopped", String::new()),
        };
        let _ = writeln!(
            out,
            "{:<42} {:<8} {:>8} {:>8} {:>8}  {detail}",
            gpu.gpu,
            state,
            gpu.pid.map_or("-".to_owned(), |p| p.to_string()),
            gpu.restarts,
            gpu.server_failures
        );
        if let Some(last) = &gpu.last_server_failure {
            let _ = writeln!(out, "{:<42} last at {}: {}", "", last.at, last.failure);
        }
    }
}

/// GPUs whose batch pods take turns: a turn's length, whose turn it is,
/// how many pods want one and the turns handed over.
fn render_turns(out: &mut String, status: &Status) {
    let gpus: Vec<_> = status.turns.iter().filter(|g| g.takes_turns).collect();
    if gpus.is_empty() {
        return;
    }
    let _ = writeln!(out, "\nTURNS");
    let _ = writeln!(
        out,
        "{:<42} {:>3} {:>8} {:<20} {:>7} {:>10}",
        "GPU", "IDX", "TURN", "HOLDER", "WANTING", "HANDOVERS"
    );
    for gpu in gpus {
        let holder = match (&gpu.holder, gpu.holder_key) {
            (Some(pod), _) => pod.clone(),
            (None, 0) => "-".to_owned(),
            (None, key) => format!("{key:016x}"),
        };
        let _ = writeln!(
            out,
            "{:<42} {:>3} {:>5} ms {:<20} {:>7} {:>10}",
            gpu.gpu,
            gpu.index,
            gpu.quantum_us as f64 / 1e3,
            holder,
            gpu.wanting,
            gpu.handovers
        );
    }
}

/// Pods under priority classes: class, time held, queueing delay.
fn render_priority(out: &mut String, status: &Status) {
    let pods: Vec<_> = status
        .pods
        .iter()
        .filter_map(|pod| Some((pod.id.as_str(), pod.priority.as_ref()?)))
        .collect();
    if pods.is_empty() {
        return;
    }
    let _ = writeln!(out, "\nPRIORITY");
    let _ = writeln!(
        out,
        "{:<20} {:<8} {:>10} {:>12} {:>14} {:>14}",
        "POD", "CLASS", "HELD", "HELD LAUNCH", "QUEUE MEAN", "QUEUE MAX"
    );
    for (id, p) in pods {
        let mean = if p.queue_delay_samples == 0 {
            "-".to_owned()
        } else {
            format!(
                "{:.0} us",
                p.queue_delay_sum_seconds / p.queue_delay_samples as f64 * 1e6
            )
        };
        let _ = writeln!(
            out,
            "{:<20} {:<8} {:>9.3}s {:>12} {:>14} {:>11.0} us",
            id,
            p.class,
            p.held_seconds,
            p.held_launches,
            mean,
            p.queue_delay_max_seconds * 1e6
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(4 << 30), "4.0 GiB");
        assert_eq!(share(0), "unlimited");
        assert_eq!(share(250_000), "25.0%");
    }

    /// A node of two GPUs, the first taking turns of 5 ms held by
    /// `trainer`, as the daemon answers; with `swaps`, after swaps:
    /// `trainer` and `web` resident on `gpu-0`, `idle` swapped out ahead of
    /// need and waiting for room.
    fn status(swaps: bool) -> Status {
        let turns = |index: u32, quantum_us: u64, holder: Option<&str>| {
            serde_json::json!({
                "gpu": format!("GPU-{index}"), "index": index, "takes_turns": quantum_us > 0,
                "automatic": false, "quantum_us": quantum_us, "holder": holder,
                "holder_key": 0, "wanting": 2, "handovers": 41,
            })
        };
        let pod = |name: &str| serde_json::json!({"pod": name, "bytes": 1u64 << 30});
        let serving = serde_json::json!({
            "resident": {"gpu-0": [pod("trainer"), pod("web")]},
            "waiting": ["idle"],
            "swaps": {"in.demand": 1, "out.ahead": 1},
            "waits": {},
            "recent": [
                {"pod": "idle", "direction": "out", "cause": "ahead"},
                {"pod": "trainer", "direction": "in", "cause": "demand"},
            ],
        });
        let mut status: Status = serde_json::from_value(serde_json::json!({
            "instance": "", "version": "", "gpus": [], "pods": [], "workers": [],
            "admission": {"buckets": [], "count": 0, "sum_seconds": 0.0, "timeouts": 0},
            "turns": [turns(0, 5_000, Some("trainer")), turns(1, 0, None)],
        }))
        .expect("a status");
        if swaps {
            status.swap.serving = serde_json::from_value(serving).expect("a serving report");
        }
        status
    }

    #[test]
    fn the_turns_table_names_the_holder_of_a_gpu_that_takes_turns() {
        let table = render_table(&status(false));
        let row = table
            .lines()
            .skip_while(|line| *line != "TURNS")
            .nth(2)
            .expect("a row");
        assert_eq!(
            row.split_whitespace().collect::<Vec<_>>(),
            ["GPU-0", "0", "5", "ms", "trainer", "2", "41"]
        );
        assert!(!table.contains("GPU-1 "), "{table}");
    }

    #[test]
    fn the_resident_set_is_shown_once_the_node_swaps() {
        assert!(
            !render_table(&status(false)).contains("RESIDENT"),
            "no swap yet"
        );
        let table = render_table(&status(true));
        let rows: Vec<&str> = table.lines().skip_while(|l| *l != "RESIDENT").collect();
        assert_eq!(
            rows[1].split_whitespace().collect::<Vec<_>>(),
            ["gpu-0", "trainer", "(1.0", "GiB),", "web", "(1.0", "GiB)"]
        );
        assert_eq!(
            rows[2],
            "SWAPS  in.demand 1  out.ahead 1  waiting for room: idle"
        );
    }
}
