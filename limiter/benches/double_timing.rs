//! How the limiter's compute path behaves in time on the driver double's
//! simulated GPU clock: the figures the CI tests leave out, since a loaded
//! machine moves them. Prints, for each scenario, the raw rounds and a
//! summary; asserts nothing.
//!
//! - `stall`: a saturating loop of 2 ms kernels at a 25% limit; the longest
//!   a single launch call waited in each round (a 2 ms kernel earns its
//!   budget back in 8 ms), and how long the launching thread waited for a
//!   CPU meanwhile.
//! - `paced`: paced loops a 50% limit does not bind (a plain kernel, 20,000
//!   grid sizes, 6,000 functions), run alternately without and with the
//!   limit; the ratio of their iteration times, median and 95% interval of
//!   the mean over the rounds.
//! - `release`: a batch pod held while a latency pod's burst runs; how long
//!   after the burst ends the batch pod launches again.
//! - `periodic`: a latency pod whose requests are due every 2 ms next to a
//!   saturating batch pod, prediction off and on; the share of requests that
//!   found a batch kernel running, and the batch pod's share of the GPU.
//!
//! Run: `cargo bench --profile dev -p cuda-limiter --bench double_timing
//! [-- SCENARIO… [--rounds N]]` (the limiter is optimised in the dev profile
//! too; `cargo bench` builds the whole workspace in release first). Timed
//! runs busy-wait on the host: run it on an otherwise idle machine.

#![allow(
    clippy::unwrap_used,
    reason = "a benchmark stops at its first failure, by panicking"
)]

#[path = "../tests/it/common/mod.rs"]
mod common;

use common::{
    Bursts, Periodic, Pod, idle_spans, line_field, number, output_lines, probe, run, times,
};

const MS: u64 = 1_000_000;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rounds = args
        .iter()
        .position(|arg| arg == "--rounds")
        .and_then(|at| args.get(at + 1))
        .map_or(5, |n| n.parse().expect("--rounds N"));
    let all = ["stall", "paced", "release", "periodic"];
    let chosen: Vec<&str> = all
        .into_iter()
        .filter(|name| args.iter().any(|arg| arg == name))
        .collect();
    let chosen = if chosen.is_empty() {
        all.to_vec()
    } else {
        chosen
    };
    println!("double_timing: {rounds} rounds of {chosen:?}");
    for scenario in chosen {
        match scenario {
            "stall" => stall(rounds),
            "paced" => paced(rounds),
            "release" => release(rounds),
            _ => periodic(rounds),
        }
    }
}

/// The probe under the limiter on a node table of its own.
fn limited(pod: &Pod, env: &[(&str, &str)], args: &[&str]) -> std::process::Command {
    let mut command = probe("cudaprobe", pod, env, args);
    command.env(
        "GPUSHARE_NODE_REGION",
        format!("gpushare-node-test-{}", pod.0),
    );
    command
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

/// The mean and the half-width of its 95% interval (normal approximation;
/// Student's t for a handful of rounds would be wider: read it as a guide).
fn mean_interval(values: &[f64]) -> (f64, f64) {
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    if values.len() < 2 {
        return (mean, f64::NAN);
    }
    let variance = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, 1.96 * (variance / n).sqrt())
}

fn stall(rounds: usize) {
    let mut stalls = Vec::new();
    for _ in 0..rounds {
        let pod = Pod::new("bench-stall");
        let lines = run(limited(
            &pod,
            &[("CUDA_DEVICE_SM_LIMIT", "25")],
            &["run", "kernel", "2000", "2000", "maxstall"],
        ));
        let stall_ms = number(&lines[1], "ns") as f64 / 1e6;
        let delay_ms = number(&lines[0], "delay_ns") as f64 / 1e6;
        println!(
            "stall round: largest {stall_ms:.2} ms, share {}‰, thread waited {delay_ms:.2} ms for a CPU",
            number(&lines[0], "share_pm")
        );
        stalls.push(stall_ms);
    }
    println!(
        "stall: 2 ms kernels at 25%: largest launch wait median {:.2} ms, worst {:.2} ms over {rounds} rounds",
        median(&stalls),
        stalls.iter().copied().fold(0.0, f64::max)
    );
}

fn paced(rounds: usize) {
    let loops: [(&str, &[&str]); 3] = [
        ("pace", &["pace", "kernel", "5", "2000", "50"]),
        ("shapes", &["shapes", "20000", "1", "20000", "20"]),
        ("functions", &["functions", "6000", "1", "12000", "20"]),
    ];
    for (name, script) in loops {
        let (mut free, mut limited_ns, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..rounds {
            // Alternated, and the order swapped each round (ABBA).
            let mut pair = [0.0; 2];
            let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
            for arm in order {
                let pod = Pod::new("bench-paced");
                let env: &[(&str, &str)] = if arm == 0 {
                    &[]
                } else {
                    &[("CUDA_DEVICE_SM_LIMIT", "50")]
                };
                let lines = run(limited(&pod, env, script));
                pair[arm] = number(&lines[0], "ns_per_iter") as f64;
            }
            free.push(pair[0]);
            limited_ns.push(pair[1]);
            ratios.push(pair[1] / pair[0]);
        }
        let (mean, half) = mean_interval(&ratios);
        println!("paced {name} rounds ns/iteration without {free:?} with {limited_ns:?}");
        println!(
            "paced {name}: without {:.0} ns, with a 50% limit {:.0} ns (medians); \
             with/without {:+.2}% median, mean {:+.2}% ± {:.2}",
            median(&free),
            median(&limited_ns),
            (median(&ratios) - 1.0) * 100.0,
            (mean - 1.0) * 100.0,
            half * 100.0
        );
    }
}

fn release(rounds: usize) {
    let mut released = Vec::new();
    for _ in 0..rounds {
        let round: Vec<f64> = Bursts::run()
            .holds()
            .into_iter()
            .filter_map(|hold| {
                hold.gap
                    .map(|(_, end)| end.saturating_sub(hold.idle_at) as f64 / 1e3)
            })
            .collect();
        println!("release round: batch released {round:?} µs after each burst");
        released.extend(round);
    }
    println!(
        "release: batch pod launches again {:.0} µs (median), {:.0} µs (worst) after the latency pod's burst, {} bursts",
        median(&released),
        released.iter().copied().fold(0.0, f64::max),
        released.len()
    );
}

/// What one run of a periodic latency pod next to a saturating batch pod saw.
struct Collisions {
    /// On-schedule arrivals past the warm-up while the batch pod ran.
    arrivals: usize,
    /// Those that found a batch kernel running.
    collided: usize,
    /// The batch pod's busy share between the first and last of them.
    batch_share: f64,
}

/// A batch pod launching 200 µs kernels back to back, and a latency pod
/// whose requests (two 100 µs kernels, then a synchronize) arrive every 2 ms
/// on a fixed schedule, prediction `predict`. The double keeps one timeline
/// per process: a batch kernel was running at an arrival if the batch pod's
/// own timeline was busy then (its idle stretches, known to a 5 µs step, do
/// not cover the arrival).
fn collisions(predict: &str) -> Collisions {
    const STEP_NS: u64 = 5_000;
    /// Requests left out at the start: nine make the first prediction, and
    /// the batch pod finds the table within 100 ms.
    const WARM_UP: usize = 15;
    /// Arrivals later than this behind their due time are left out: no
    /// prediction can place a request its own process did not make on time.
    const ON_TIME_NS: u64 = 200_000;
    const PERIOD_NS: u64 = 2 * MS;
    // Bound whole: the pods' objects live until the end of the function.
    let pods = Periodic::start(
        predict,
        &["clock", "run", "kernel", "200", "800", "idle", "5"],
    );
    let latency_lines = output_lines(pods.latency_child);
    let batch_lines = output_lines(pods.batch_child);

    let batch_start = times(&batch_lines, "clock")[0];
    let batch_end = batch_start
        + line_field(&batch_lines, "run ", "wall_ns")
            .parse::<u64>()
            .expect("wall");
    let gaps = idle_spans(&batch_lines);
    let all: Vec<u64> = line_field(&latency_lines, "periodic ", "at")
        .split(',')
        .map(|at| at.parse().expect("arrival"))
        .collect();
    // Request i is due PERIOD_NS * i after the first (the probe's schedule).
    let first = all.first().copied().unwrap_or(0);
    let arrivals: Vec<u64> = (0u64..)
        .zip(&all)
        .skip(WARM_UP)
        .filter(|&(i, &at)| at.saturating_sub(first + i * PERIOD_NS) <= ON_TIME_NS)
        .map(|(_, &at)| at)
        .filter(|&at| at > batch_start && at + MS < batch_end)
        .collect();
    let collided = arrivals
        .iter()
        .filter(|&&at| !gaps.iter().any(|&(a, b)| a <= at && at < b))
        .count();
    let (from, to) = (
        arrivals.first().copied().unwrap_or(0),
        arrivals.last().copied().unwrap_or(0),
    );
    let idle_ns: u64 = gaps
        .iter()
        .map(|&(a, b)| b.min(to).saturating_sub(a.max(from)))
        .sum();
    let span = to.saturating_sub(from).max(STEP_NS);
    Collisions {
        arrivals: arrivals.len(),
        collided,
        batch_share: 1.0 - idle_ns as f64 / span as f64,
    }
}

fn periodic(rounds: usize) {
    for (predict, name) in [("0", "off"), ("1", "on")] {
        let (mut shares, mut batch) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            let seen = collisions(predict);
            let share = seen.collided as f64 / seen.arrivals.max(1) as f64;
            println!(
                "periodic round, prediction {name}: {} of {} requests found a batch kernel running, batch share {:.3}",
                seen.collided, seen.arrivals, seen.batch_share
            );
            shares.push(share);
            batch.push(seen.batch_share);
        }
        println!(
            "periodic, prediction {name}: {:.1}% of requests found a batch kernel running (median), batch pod busy {:.1}% (median)",
            median(&shares) * 100.0,
            median(&batch) * 100.0
        );
    }
}
