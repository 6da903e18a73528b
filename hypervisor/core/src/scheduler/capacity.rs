//! The time the elastic pods of a co-run GPU split: 100% of the GPU's, more
//! while the GPU idles though they use all they are given.
//!
//! Beside other MPS clients, a kernel's blocks wait for the SMs another
//! client's kernel holds: its measured time, and so its charge, covers time
//! in which the GPU ran someone else's blocks. Pods that split 100% of the
//! time by such charges run out of budget while the GPU still has room (16
//! pods of full-GPU kernels on an H100 got 89% of what one process does
//! alone). The GPU says how much of the time a kernel ran at all: while it
//! was busy less than [`GROW_BELOW`] percent and the elastic pods used
//! [`HUNGRY`] of their rates or more, what they split grows with the idle
//! time; once the GPU is busy all the time it shrinks, back to 100%, so that
//! the weights decide again what each pod gets of a full GPU. Only idle time
//! is handed out: a capped pod keeps its cap and a fixed pod its share
//! ([`plan`](crate::fairshare::plan)); time-sliced GPUs stay at 100% (a
//! context switch is time the GPU gives the pod that caused it).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use gpushare_utils::bucket::PPM;

use super::*;

/// Busy less than this (percent), the GPU has room to hand out.
pub const GROW_BELOW: u32 = 97;
/// Busy this much (percent), the GPU is full: the weights must decide.
const FULL: u32 = 100;
/// The elastic pods use what they are given: together, at least this
/// share of their rates.
pub const HUNGRY: f64 = 0.9;
/// At most this much more than the GPU's time is split. The charges of 16
/// pods of full-GPU kernels came to 1.6 times what they took at 150%, and
/// grow with the pods' budgets (more clients in flight, longer waits for
/// SMs): the bound is the GPU's busy share, this only a guard against a
/// GPU that reads idle while it is not.
pub const MAX_CAPACITY_PPM: u32 = 4_000_000;
/// A sample grows the capacity by this much for each point of idle time
/// under [`GROW_BELOW`] (95% busy: by 20%), at most [`MAX_GROWTH`]: the
/// charges grow with the pods' budgets, so the capacity must grow faster
/// than the idle time shrinks, and settle within a few samples (an H100
/// takes one every 200 ms).
const GAIN: f64 = 10.0;
const MAX_GROWTH: f64 = 1.5;
/// A full GPU shrinks it by this factor a sample; pods that use less than
/// they are given, by [`IDLE_SHRINK`].
const FULL_SHRINK: f64 = 0.9;
const IDLE_SHRINK: f64 = 0.98;
/// A pod's use is measured over at least this long.
const MIN_SPAN: Duration = Duration::from_millis(20);

/// The capacity after one busy sample: `busy` percent, with the elastic
/// pods `hungry` or not.
pub fn next_capacity(ppm: u32, busy: u32, hungry: bool) -> u32 {
    let ppm_f = f64::from(ppm);
    let next = if busy >= FULL {
        ppm_f * FULL_SHRINK
    } else if !hungry {
        ppm_f * IDLE_SHRINK
    } else if busy < GROW_BELOW {
        let idle = f64::from(GROW_BELOW - busy) / 100.0;
        ppm_f * (1.0 + GAIN * idle).min(MAX_GROWTH)
    } else {
        ppm_f
    };
    (next.round() as u32).clamp(PPM as u32, MAX_CAPACITY_PPM)
}

impl Scheduler {
    /// The time the elastic pods of GPU `uuid` split, in ppm of wall time.
    /// Read by every tick: the few GPUs above 100% are looked through, no
    /// key is made.
    pub fn elastic_capacity(&self, uuid: &str) -> u32 {
        self.capacity
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(uuid))
            .map_or(PPM as u32, |(_, &ppm)| ppm)
    }

    /// The co-run GPUs whose elastic pods may get more than the GPU's time:
    /// (NVML index, UUID) of each that has an elastic pod placed, or still
    /// a capacity above 100% (which its next sample takes back).
    pub fn busy_watched(&self) -> Vec<(u32, String)> {
        let Some(corun) = &self.corun else {
            return Vec::new();
        };
        self.gpus
            .iter()
            .filter(|gpu| corun.covers(&gpu.uuid))
            .filter(|gpu| {
                self.capacity.contains_key(&gpu.uuid.to_ascii_lowercase())
                    || self.pods.values().flat_map(|p| &p.gpus).any(|g| {
                        g.spec.policy == Policy::Elastic
                            && g.placement
                                .as_ref()
                                .is_some_and(|p| p.uuid.eq_ignore_ascii_case(&gpu.uuid))
                    })
            })
            .map(|gpu| (gpu.index, gpu.uuid.clone()))
            .collect()
    }

    /// Notes that co-run GPU `uuid` was busy `busy` percent of the time
    /// since its last sample, and sets what its elastic pods split (see the
    /// module documentation); reschedules the GPU when that changed.
    pub fn note_busy(&mut self, uuid: &str, busy: u32, now: Instant) {
        let key = uuid.to_ascii_lowercase();
        if !self.corun.as_ref().is_some_and(|c| c.covers(&key)) {
            return;
        }
        // What the GPU's active elastic pods were given and used since the
        // last sample, in ppm·ns.
        let (mut given, mut used, mut elastic) = (0u128, 0u128, false);
        for pod in self.pods.values_mut() {
            for gpu in &mut pod.gpus {
                let Some(placement) = gpu
                    .placement
                    .as_ref()
                    .filter(|p| p.uuid.eq_ignore_ascii_case(&key))
                else {
                    continue;
                };
                let Some(bucket) = pod.region.bucket(&placement.uuid) else {
                    continue;
                };
                let charged = bucket.charged_ns.load(Ordering::Relaxed);
                let mark = gpu.busy_mark.replace((now, charged));
                if !gpu.active || gpu.spec.policy != Policy::Elastic {
                    continue;
                }
                elastic = true;
                let Some((then, before)) = mark else {
                    continue;
                };
                let span = now.saturating_duration_since(then);
                if span >= MIN_SPAN {
                    given += span.as_nanos() * u128::from(gpu.grant.rate_ppm);
                    used += u128::from(charged.saturating_sub(before)) * u128::from(PPM);
                }
            }
        }
        let now_ppm = self.elastic_capacity(&key);
        let next = match elastic {
            false => PPM as u32,
            true => next_capacity(
                now_ppm,
                busy,
                given > 0 && used as f64 >= HUNGRY * given as f64,
            ),
        };
        if next != now_ppm {
            tracing::debug!(gpu = %key, busy, capacity_ppm = next, "elastic capacity");
            if next == PPM as u32 {
                self.capacity.remove(&key);
            } else {
                self.capacity.insert(key.clone(), next);
            }
            self.tick(now, Some(&key));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_grows_with_idle_time_while_pods_are_hungry_and_shrinks_when_full() {
        let one = PPM as u32;
        // 96% busy: by 10%; 95%: by 20%; at most MAX_GROWTH a sample.
        assert_eq!(next_capacity(one, 96, true), 1_100_000);
        assert_eq!(next_capacity(one, 95, true), 1_200_000);
        assert_eq!(next_capacity(one, 89, true), 1_500_000);
        // Busy enough: holds.
        assert_eq!(next_capacity(1_100_000, 98, true), 1_100_000);
        // Pods that leave budget unused: nothing to hand out.
        assert_eq!(next_capacity(1_100_000, 80, false), 1_078_000);
        // Full: the weights decide again.
        assert_eq!(next_capacity(1_100_000, 100, true), 1_000_000);
        assert_eq!(next_capacity(2_000_000, 100, true), 1_800_000);
        // Never under the GPU's time, never over the most.
        assert_eq!(next_capacity(one, 100, true), one);
        assert_eq!(next_capacity(one, 90, false), one);
        assert_eq!(next_capacity(MAX_CAPACITY_PPM, 10, true), MAX_CAPACITY_PPM);
    }

    #[test]
    fn capacity_settles_where_the_gpu_is_busy_enough() {
        // A GPU whose busy share follows what 16 pods of full-GPU kernels
        // did on an H100 (89% of one process at 100%, 92% at 150%, 95% at
        // 230%: the charges grow with the budgets); full past 400%.
        let busy_at = |ppm: u32| {
            let x = f64::from(ppm) / 1e6;
            (89.0 + 6.0 * (x - 1.0)).min(100.0).round() as u32
        };
        let mut ppm = PPM as u32;
        let mut samples = 0;
        while !(GROW_BELOW..FULL).contains(&busy_at(ppm)) {
            ppm = next_capacity(ppm, busy_at(ppm), true);
            samples += 1;
            assert!(samples <= 3, "{ppm} ppm after {samples} samples");
        }
        // And stays.
        for _ in 0..20 {
            ppm = next_capacity(ppm, busy_at(ppm), true);
            assert!((GROW_BELOW..FULL).contains(&busy_at(ppm)), "{ppm} ppm");
        }
    }
}
