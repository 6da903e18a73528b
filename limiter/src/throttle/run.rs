//! Runs: stretches of one stream's launches measured end to end, which say
//! how far single-launch brackets overstate what launches take back to back.
//!
//! Brackets are calibrated with an empty kernel of ours, but the event
//! right before a launch may also keep the launch's ramp from overlapping
//! the kernel before it, as it does back to back, and no calibration kernel
//! has the application's ramp. On the H100 brackets overstated by well under
//! 1% (the scale settled at 0.994 for back-to-back 50 µs kernels, 0.990 to
//! 0.996 for a PyTorch inference step); the driver double's event ramp
//! (`GPUSHARE_DOUBLE_EVENT_RAMP_NS`) makes a larger error to test against.
//!
//! A run brackets up to [`RUN_LAUNCHES`] launches of one thread on one
//! stream with one pair of events: only its first launch follows an event.
//! Its GPU time against what its launches were charged gives a ratio, and
//! the process's [`RunScale`] follows it, within [`MIN_SCALE_PPM`] and 1:
//! every bracket's measurement is scaled by it before it prices anything.
//! A run counts only where it tells nothing but the launches' own time:
//! every one of its launches found the stream still busy (a stream query
//! before each: no idle gap inside), no other pod launched on the device,
//! none of its launches was priced before its function was measured, and
//! none failed. Work of another thread on the same stream inside a run
//! makes it longer, never shorter, and the scale never goes above 1: runs
//! can bring charges down to what the launches took, never above what the
//! brackets say.

use std::sync::atomic::{AtomicU32, Ordering};

use crate::metering::Charge;
use crate::sys::{CUevent, CUstream};

/// Launches a run holds at most.
pub(super) const RUN_LAUNCHES: u32 = 32;
/// GPU time charged to a run's launches, at most, before it closes: long
/// enough that its first launch's ramp is a few thousandths of it, short
/// enough that a host loop seldom lets the stream run dry inside.
pub(super) const RUN_CHARGED_NS: u64 = 1_000_000;
/// One due sample in this many opens a run instead.
pub(super) const RUN_EVERY: u32 = 4;
/// The scale in millionths: 1.
pub(super) const SCALE_ONE_PPM: u32 = 1_000_000;
/// The least scale: whatever runs say, a bracket is taken to overstate a
/// launch by a fifth at most.
pub(super) const MIN_SCALE_PPM: u32 = 800_000;
/// How far one run moves the scale towards its ratio.
const GAIN: f64 = 1.0 / 8.0;

/// The run a thread has open, and its count towards the next; all zero: no
/// run open, none due.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Run {
    stream: usize,
    context: usize,
    device: usize,
    start: usize,
    /// The run's launches so far; 0: no run open.
    launches: u32,
    charged_ns: u64,
    /// A launch priced before its function was measured (its charge is a
    /// guess), one that failed, or one that found the stream idle.
    spoiled: bool,
    /// Due samples since the last run opened.
    samples_since: u32,
}

// SAFETY: integers and booleans; all zero is no run open.
unsafe impl gpushare_hook::thread_local::ZeroInit for Run {}

/// A run closed before a launch: what its events cover.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Closed {
    pub(super) stream: CUstream,
    pub(super) context: usize,
    pub(super) device: usize,
    pub(super) start: CUevent,
    pub(super) tally: Tally,
}

/// What a closed run's launches were charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Tally {
    pub(super) launches: u32,
    pub(super) charged_ns: u64,
    /// Usable: every launch was priced from measurements, ran, and found
    /// the stream busy.
    pub(super) priced: bool,
}

/// What [`Run::add`] did with a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Added {
    /// No run open.
    Outside,
    /// Counted into the open run, which still counts: the caller checks
    /// that the stream is busy before the launch (else [`Run::spoil`]).
    Counted,
    /// Counted into a run that no longer counts.
    Spoiled,
    /// The run closed before this launch, which is in none.
    Closed(Closed),
}

impl Run {
    #[inline]
    fn is_open(&self) -> bool {
        self.launches != 0
    }

    /// Whether the due sample of a launch should open a run: one in
    /// [`RUN_EVERY`], and none already open.
    #[inline]
    pub(super) fn wants_one(&mut self) -> bool {
        if self.is_open() {
            return false;
        }
        self.samples_since += 1;
        self.samples_since >= RUN_EVERY
    }

    /// Opens a run at a launch on `stream` (of `context`, on `device`)
    /// charged `charge`, whose start event `start` was recorded before it.
    pub(super) fn open(
        &mut self,
        stream: CUstream,
        context: usize,
        device: usize,
        start: CUevent,
        charge: &Charge,
    ) {
        *self = Self {
            stream: stream as usize,
            context,
            device,
            start: start as usize,
            launches: 1,
            charged_ns: charge.ns,
            spoiled: charge.unmeasured,
            samples_since: 0,
        };
    }

    /// Counts a launch on `stream` charged `charge` into the open run, or
    /// closes the run before it when it is on another stream or the run is
    /// full (the caller records the end event before the launch).
    #[inline]
    pub(super) fn add(&mut self, stream: CUstream, charge: &Charge) -> Added {
        if !self.is_open() {
            return Added::Outside;
        }
        if self.stream == stream as usize
            && self.launches < RUN_LAUNCHES
            && self.charged_ns < RUN_CHARGED_NS
        {
            self.launches += 1;
            self.charged_ns = self.charged_ns.saturating_add(charge.ns);
            self.spoiled |= charge.unmeasured;
            return if self.spoiled {
                Added::Spoiled
            } else {
                Added::Counted
            };
        }
        self.close().map_or(Added::Outside, Added::Closed)
    }

    /// Marks the open run as no measure of its launches (one failed, or
    /// found the stream idle).
    pub(super) fn spoil(&mut self) {
        self.spoiled = true;
    }

    /// Closes the open run, if any (before a wait, which lets the stream
    /// run dry).
    pub(super) fn close(&mut self) -> Option<Closed> {
        if !self.is_open() {
            return None;
        }
        let closed = Closed {
            stream: self.stream as CUstream,
            context: self.context,
            device: self.device,
            start: self.start as CUevent,
            tally: Tally {
                launches: self.launches,
                charged_ns: self.charged_ns,
                priced: !self.spoiled,
            },
        };
        *self = Self {
            samples_since: self.samples_since,
            ..Self::default()
        };
        Some(closed)
    }
}

/// How much of a bracket's measurement is the launch's own back-to-back
/// time, in millionths; written by the monitor thread only.
pub(super) struct RunScale {
    ppm: AtomicU32,
}

impl Default for RunScale {
    fn default() -> Self {
        Self {
            ppm: AtomicU32::new(SCALE_ONE_PPM),
        }
    }
}

impl RunScale {
    /// `measured_ns` of a bracket, as the launch's back-to-back time.
    pub(super) fn apply(&self, measured_ns: u64) -> u64 {
        let ppm = u64::from(self.ppm.load(Ordering::Relaxed));
        (u128::from(measured_ns) * u128::from(ppm) / u128::from(SCALE_ONE_PPM)) as u64
    }

    /// Moves the scale towards what a run says: its launches took `gpu_ns`
    /// and were charged `charged_ns` at the current scale.
    pub(super) fn note(&self, gpu_ns: u64, charged_ns: u64) {
        if charged_ns == 0 {
            return;
        }
        let ratio = gpu_ns as f64 / charged_ns as f64;
        let ppm = f64::from(self.ppm.load(Ordering::Relaxed));
        let next = ppm * (1.0 + GAIN * (ratio - 1.0));
        let next = next.clamp(f64::from(MIN_SCALE_PPM), f64::from(SCALE_ONE_PPM));
        self.ppm.store(next.round() as u32, Ordering::Relaxed);
    }

    /// The scale, in millionths (for the exit summary).
    pub(super) fn ppm(&self) -> u32 {
        self.ppm.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn charge(ns: u64, unmeasured: bool) -> Charge {
        Charge {
            ns,
            waves: 1,
            slot: None,
            unmeasured,
            wanted: false,
            ahead: 0,
        }
    }

    fn stream(n: usize) -> CUstream {
        n as CUstream
    }

    #[test]
    fn one_due_sample_in_four_opens_a_run_and_none_while_one_is_open() {
        let mut run = Run::default();
        let wanted: Vec<bool> = (0..4).map(|_| run.wants_one()).collect();
        assert_eq!(wanted, [false, false, false, true]);
        // Not opened (an idle stream): the next due sample tries again.
        assert!(run.wants_one());
        run.open(stream(1), 7, 0, 9 as CUevent, &charge(10, false));
        assert!(!run.wants_one());
        assert!(run.close().is_some());
        let wanted: Vec<bool> = (0..4).map(|_| run.wants_one()).collect();
        assert_eq!(wanted, [false, false, false, true]);
    }

    #[test]
    fn a_run_counts_its_streams_launches_and_closes_before_another_streams() {
        let mut run = Run::default();
        assert_eq!(run.add(stream(1), &charge(10, false)), Added::Outside);
        run.open(stream(1), 7, 3, 9 as CUevent, &charge(10, false));
        assert_eq!(run.add(stream(1), &charge(20, false)), Added::Counted);
        assert_eq!(run.add(stream(1), &charge(30, false)), Added::Counted);
        let closed = match run.add(stream(2), &charge(40, false)) {
            Added::Closed(c) => Some((c.stream, c.context, c.device, c.start, c.tally)),
            _ => None,
        };
        let tally = Tally {
            launches: 3,
            charged_ns: 60,
            priced: true,
        };
        // Its own stream, context and GPU, whatever the launch that closed it.
        assert_eq!(closed, Some((stream(1), 7, 3, 9 as CUevent, tally)));
        // Closed: the next launch counts nowhere.
        assert_eq!(run.add(stream(1), &charge(10, false)), Added::Outside);
        assert_eq!(run.close().map(|c| c.tally), None);
    }

    /// The tally of the run `added` closed, if it did.
    fn tally(added: Added) -> Option<Tally> {
        match added {
            Added::Closed(closed) => Some(closed.tally),
            _ => None,
        }
    }

    #[test]
    fn a_run_closes_when_full_and_a_guess_a_failure_or_an_idle_stream_spoils_it() {
        let mut run = Run::default();
        run.open(stream(1), 7, 0, 9 as CUevent, &charge(1, false));
        for _ in 1..RUN_LAUNCHES {
            assert_eq!(run.add(stream(1), &charge(1, false)), Added::Counted);
        }
        let full = tally(run.add(stream(1), &charge(1, false)));
        assert_eq!(
            full.map(|t| (t.launches, t.priced)),
            Some((RUN_LAUNCHES, true))
        );

        run.open(
            stream(1),
            7,
            0,
            9 as CUevent,
            &charge(RUN_CHARGED_NS, false),
        );
        let long = tally(run.add(stream(1), &charge(1, true)));
        assert_eq!(
            long.map(|t| t.launches),
            Some(1),
            "a run charged its limit closes"
        );

        run.open(stream(1), 7, 0, 9 as CUevent, &charge(10, false));
        assert_eq!(run.add(stream(1), &charge(10, true)), Added::Spoiled);
        let guessed = run.close().map(|c| c.tally);
        assert_eq!(guessed.map(|t| (t.launches, t.priced)), Some((2, false)));

        run.open(stream(1), 7, 0, 9 as CUevent, &charge(10, false));
        assert_eq!(run.add(stream(1), &charge(10, false)), Added::Counted);
        run.spoil();
        assert_eq!(run.add(stream(1), &charge(10, false)), Added::Spoiled);
        assert_eq!(run.close().map(|c| c.tally.priced), Some(false));
    }

    #[test]
    fn the_scale_settles_at_what_runs_took_and_never_above_one() {
        let scale = RunScale::default();
        assert_eq!(scale.apply(1_000), 1_000);
        // Brackets read 225 where launches took 212.6 back to back: each
        // run's charge is the brackets' scaled by the scale of the moment.
        for _ in 0..200 {
            let charged = scale.apply(225_000);
            scale.note(212_600, charged);
        }
        let settled = f64::from(scale.ppm()) / f64::from(SCALE_ONE_PPM);
        assert!((settled - 212.6 / 225.0).abs() < 0.001, "{settled}");
        // Runs longer than their charges bring it back to 1, not beyond.
        for _ in 0..200 {
            scale.note(300_000, 200_000);
        }
        assert_eq!(scale.ppm(), SCALE_ONE_PPM);
        // Nor below the floor, whatever a run says.
        for _ in 0..200 {
            scale.note(1, 200_000);
        }
        assert_eq!(scale.ppm(), MIN_SCALE_PPM);
        scale.note(1, 0);
        assert_eq!(scale.ppm(), MIN_SCALE_PPM);
    }
}
