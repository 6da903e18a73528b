//! The cost model's tests: prices, fits, settlements, batches.

use super::floor::{FLOOR_RING, Recent};
use super::*;

const US: u64 = 1_000;

/// A charge added to its entry at once: a batch of one.
fn charge(model: &CostModel, key: LaunchKey, waves: u64) -> Charge {
    let mut batch = Batch::default();
    let charge = model.charge(key, waves, &mut batch);
    model.flush(&mut batch);
    charge
}

fn refund(model: &CostModel, charge: &Charge) {
    model.refund(charge, &mut Batch::default());
}

fn price(model: &CostModel, key: LaunchKey, waves: u64) -> u64 {
    let charged = charge(model, key, waves);
    refund(model, &charged);
    charged.ns
}

#[test]
fn a_function_measured_at_a_few_sizes_prices_every_other() {
    let model = CostModel::default();
    let key = LaunchKey::kernel(0x1000);
    // A kernel of 2 µs plus 0.5 µs a wave, measured at 1 to 4 waves.
    for round in 0..40 {
        let waves = 1 + round % 4;
        let charge = charge(&model, key, waves);
        model.record(&charge, 2 * US + waves * US / 2, Contention::Alone);
    }
    for waves in [1u64, 10, 100, 2_000] {
        let want = 2 * US + waves * US / 2;
        let got = price(&model, key, waves);
        assert!(
            got.abs_diff(want) <= want / 50,
            "{waves} waves: {got} ns, want {want}"
        );
    }
}

#[test]
fn one_size_only_is_priced_as_it_was_measured() {
    let model = CostModel::default();
    let key = LaunchKey::kernel(0x2000);
    let first = charge(&model, key, 1);
    assert!(first.wanted && first.unmeasured);
    assert_eq!(first.ns, INITIAL_PER_WAVE_NS);
    // Measured at 50 µs: its charge is settled at that.
    assert_eq!(
        model.record(&first, 50 * US, Contention::Alone),
        signed(30 * US)
    );
    assert_eq!(price(&model, key, 1), 50 * US);
    // Larger grids: the time beyond a launch's fixed part scales.
    assert_eq!(price(&model, key, 10), 3 * US + 10 * 47 * US);
}

#[test]
fn a_measurement_settles_every_launch_since_the_last() {
    let model = CostModel::default();
    let key = LaunchKey::kernel(7);
    let charges: Vec<Charge> = (0..6).map(|_| charge(&model, key, 1)).collect();
    assert!(charges[0].wanted);
    assert!(model.awaiting_measurement(&charges[5]));
    assert!(charges[1..].iter().all(|charge| !charge.wanted));
    assert_eq!(
        charges.iter().map(|c| c.ahead).collect::<Vec<_>>(),
        [0, 1, 2, 3, 4, 5]
    );
    let charged: u64 = charges.iter().map(|c| c.ns).sum();
    // 2 ms each: the pod owes what 6 launches cost, less what it paid.
    let owed = model.record(&charges[0], 2_000 * US, Contention::Alone);
    assert_eq!(owed, signed(6 * 2_000 * US) - signed(charged));
    assert!(!model.awaiting_measurement(&charges[5]));
    // The function slows down (a longer KV cache, say): the launches
    // priced before are settled at the updated price.
    let slower: Vec<Charge> = (0..10).map(|_| charge(&model, key, 1)).collect();
    assert!(slower.iter().all(|charge| charge.ns == 2_000 * US));
    let owed = model.record(&slower[3], 3_000 * US, Contention::Alone);
    let updated = price(&model, key, 1);
    assert!(updated > 2_000 * US && updated < 3_000 * US, "{updated}");
    assert_eq!(owed, 10 * (signed(updated) - signed(2_000 * US)));
    // Settled once: nothing is left for a later measurement.
    let later = charge(&model, key, 1);
    let owed = model.record(&later, later.ns, Contention::Alone);
    assert_eq!(owed, signed(price(&model, key, 1)) - signed(later.ns));
}

#[test]
fn prices_follow_the_mean_of_varying_measurements() {
    let model = CostModel::default();
    let key = LaunchKey::kernel(9);
    // Alternating 100 and 200 µs at one size: priced at the mean.
    for round in 0..200 {
        let charge = charge(&model, key, 1);
        model.record(
            &charge,
            if round % 2 == 0 { 100 * US } else { 200 * US },
            Contention::Alone,
        );
    }
    let mean = price(&model, key, 1);
    assert!((140 * US..=160 * US).contains(&mean), "{mean}");
    // Beside time-sliced pods an inflated measurement counts as the median
    // of the recent ones: the price hardly moves.
    let charge = charge(&model, key, 1);
    model.record(&charge, mean + 800 * US, Contention::TimeSliced);
    let moved = price(&model, key, 1);
    assert!(moved.abs_diff(mean) < 5 * US, "{mean} -> {moved}");
}

#[test]
fn a_floor_reads_its_recent_ratios_at_their_lower_quartile_and_median() {
    let recent = |lower_quartile, median| Recent {
        lower_quartile,
        median,
    };
    // One ratio kept: it is both.
    let floor = Floor::default();
    assert_eq!(floor.note(1.5), recent(1.5, 1.5));
    // Two: the median is the lower, the lower quartile the second least.
    assert_eq!(floor.note(3.0), recent(3.0, 1.5));
    // All equal: that ratio, once the ring holds only it.
    let equal = Floor::default();
    for _ in 0..FLOOR_RING {
        equal.note(0.5);
    }
    assert_eq!(equal.note(2.0), recent(0.5, 0.5));
    for _ in 0..FLOOR_RING - 1 {
        equal.note(2.0);
    }
    assert_eq!(equal.note(2.0), recent(2.0, 2.0));
    // Seven ratios around 1, then a time slice's 12: neither moves.
    let spread = Floor::default();
    for ratio in [1.0, 1.125, 0.875, 1.25, 1.0625, 0.9375] {
        spread.note(ratio);
    }
    assert_eq!(spread.note(1.1875), recent(0.9375, 1.0625));
    assert_eq!(spread.note(12.0), recent(0.9375, 1.0625));
}

#[test]
fn on_shared_sms_a_kernel_is_priced_near_the_least_it_took() {
    let model = CostModel::default();
    let key = LaunchKey::kernel(10);
    let record = |us: u64, contention| {
        let charge = charge(&model, key, 1);
        model.record(&charge, us * US, contention)
    };
    // Beside other MPS clients' kernels a 100 µs kernel takes 100 to 400 µs:
    // priced near the least (the lower quartile: the second least of eight,
    // 150), where time slices would hold it far higher.
    let stretched = [400, 250, 100, 300, 150, 400, 200, 350];
    for us in stretched.iter().cycle().take(400) {
        record(*us, Contention::SharedSms);
    }
    let shared = price(&model, key, 1);
    assert!((100 * US..=155 * US).contains(&shared), "{shared}");
    let sliced = CostModel::default();
    for us in stretched.iter().cycle().take(400) {
        let charge = charge(&sliced, key, 1);
        sliced.record(&charge, us * US, Contention::TimeSliced);
    }
    assert!(price(&sliced, key, 1) > shared + 30 * US);
    // A kernel that really takes longer now (600 µs, every measurement
    // beside others) is priced so within about a hundred measurements; not
    // while the recent ones it took less still count.
    for _ in 0..FLOOR_RING - 2 {
        record(600, Contention::SharedSms);
    }
    let held = price(&model, key, 1);
    assert!(held <= 155 * US, "{held}");
    for _ in 0..100 {
        record(600, Contention::SharedSms);
    }
    let longer = price(&model, key, 1);
    assert!(longer >= 500 * US, "{longer}");
}

#[test]
fn a_kernel_stretched_beside_other_mps_clients_is_priced_near_the_lower_quartile_of_what_it_took() {
    let model = CostModel::default();
    let key = LaunchKey::kernel(11);
    // Measured alone at 450 µs, then beside other clients, never alone
    // again: each measurement stretched by 5 to 40%. Priced near the lower
    // quartile of what it took (5 to 10% over), where following every
    // measurement would price it at their mean (22% over).
    for _ in 0..8 {
        let charge = charge(&model, key, 1);
        model.record(&charge, 450 * US, Contention::Alone);
    }
    let stretch = [1.25, 1.05, 1.4, 1.1, 1.3, 1.15, 1.2, 1.35];
    for factor in stretch.iter().cycle().take(2_000) {
        let charge = charge(&model, key, 1);
        model.record(&charge, (450.0 * factor) as u64 * US, Contention::SharedSms);
    }
    let shared = price(&model, key, 1);
    assert!((450 * US..=500 * US).contains(&shared), "{shared}");
    // One measurement in sixteen read short (its bracket's overhead taken
    // as more than it was) does not lower the price.
    for (n, factor) in stretch.iter().cycle().take(2_000).enumerate() {
        let us = if n % 16 == 0 { 270.0 } else { 450.0 * factor };
        let charge = charge(&model, key, 1);
        model.record(&charge, us as u64 * US, Contention::SharedSms);
    }
    let outliers = price(&model, key, 1);
    assert!((450 * US..=500 * US).contains(&outliers), "{outliers}");
    // A kernel of varying length is priced near its shortest, never below.
    let varied = CostModel::default();
    for round in 0..2_000 {
        let charge = charge(&varied, key, 1);
        let us = if round % 2 == 0 { 300 } else { 500 };
        varied.record(&charge, us * US, Contention::SharedSms);
    }
    let least = price(&varied, key, 1);
    assert!((295 * US..=330 * US).contains(&least), "{least}");
}

#[test]
fn beside_time_sliced_pods_a_short_kernel_is_charged_what_it_takes_not_their_slices() {
    let model = CostModel::default();
    let key = LaunchKey::kernel(12);
    // A 27 µs kernel beside other pods on a time-sliced GPU: one
    // measurement in fifty holds another context's 3 ms time slice. The
    // pod pays for its launches within 3% of what they took, where
    // weighing those measurements a quarter charged it about half as much
    // again.
    let launches = 1_000;
    let mut paid = 0;
    for n in 0..launches {
        let charge = charge(&model, key, 1);
        let us = if n % 50 == 49 { 3_000 } else { 27 };
        paid += signed(charge.ns) + model.record(&charge, us * US, Contention::TimeSliced);
    }
    let took = signed(launches * 27 * US);
    assert!(
        paid.abs_diff(took) <= took.unsigned_abs() * 3 / 100,
        "paid {paid} ns for {took}"
    );
    let priced = price(&model, key, 1);
    assert!(priced.abs_diff(27 * US) <= 27 * US * 3 / 100, "{priced}");
}

#[test]
fn beside_time_sliced_pods_a_kernel_that_really_takes_longer_is_priced_so() {
    let model = CostModel::default();
    let key = LaunchKey::kernel(13);
    let record = |us: u64| {
        let charge = charge(&model, key, 1);
        model.record(&charge, us * US, Contention::TimeSliced);
    };
    for _ in 0..100 {
        record(27);
    }
    // Every measurement 40 µs from now on (a longer sequence, say): priced
    // so within a few dozen measurements, not held at the old price.
    for _ in 0..40 {
        record(40);
    }
    let longer = price(&model, key, 1);
    assert!(longer.abs_diff(40 * US) <= 40 * US * 3 / 100, "{longer}");
}

#[test]
fn unknown_functions_cost_the_process_price_and_a_full_table_stays_cheap() {
    let model = CostModel::default();
    let seed = charge(&model, LaunchKey::kernel(1), 1);
    model.record(&seed, 30 * US, Contention::Alone);
    // Ten times more functions than slots, each launched once with a
    // different grid: no charge is a default of milliseconds, and past the
    // table's room, nothing asks for a measurement.
    let mut firsts = 0;
    let mut unslotted = Vec::new();
    for function in 2..(SLOTS * 10) {
        let charge = charge(
            &model,
            LaunchKey::kernel(function),
            1 + (function as u64 % 3),
        );
        assert!(charge.ns <= 3 * 30 * US, "charged {} ns", charge.ns);
        firsts += usize::from(charge.wanted);
        if charge.slot.is_none() {
            unslotted.push(charge);
        }
    }
    assert!(firsts <= SLOTS, "{firsts} measurements asked for");
    assert!(
        unslotted.len() >= SLOTS * 8,
        "{} without a slot",
        unslotted.len()
    );
    // One measurement of a launch without a slot settles them all at
    // the process-wide price it updates.
    let charged: u64 = unslotted.iter().map(|charge| charge.ns).sum();
    let launches = unslotted.len() as u64;
    let waves: u64 = unslotted.iter().map(|charge| charge.waves).sum();
    let owed = model.record(&unslotted[0], 40 * US, Contention::Alone);
    let (fixed, per_wave) = model.process_price();
    let want = signed(fixed * launches + per_wave * waves) - signed(charged);
    assert_eq!(owed, want);
}

#[test]
fn functions_sharing_a_home_entry_keep_their_own_entries_and_prices() {
    let model = CostModel::default();
    let home = |function: usize| LaunchKey::kernel(function).0 as usize % SLOTS;
    // Three functions with one home entry: the second and third are
    // placed past it, and each is found again where it was placed.
    let first = 1;
    let others: Vec<usize> = (2..)
        .filter(|&function| home(function) == home(first))
        .take(2)
        .collect();
    let functions = [first, others[0], others[1]];
    let slots: Vec<Option<usize>> = functions
        .iter()
        .map(|&function| model.slot(LaunchKey::kernel(function)))
        .collect();
    assert_eq!(slots[0], Some(home(first)));
    assert!(slots.iter().all(Option::is_some), "{slots:?}");
    assert!(slots[0] != slots[1] && slots[1] != slots[2] && slots[0] != slots[2]);
    for (&function, &slot) in functions.iter().zip(&slots) {
        assert_eq!(model.slot(LaunchKey::kernel(function)), slot);
    }
    for (&function, us) in functions.iter().zip([10, 20, 40]) {
        let charge = charge(&model, LaunchKey::kernel(function), 1);
        model.record(&charge, us * US, Contention::Alone);
    }
    let prices: Vec<u64> = functions
        .iter()
        .map(|&function| price(&model, LaunchKey::kernel(function), 1))
        .collect();
    assert_eq!(prices, [10 * US, 20 * US, 40 * US]);
}

#[test]
fn a_threads_launches_of_one_function_reach_its_entry_in_batches() {
    let model = CostModel::default();
    let (key, other) = (LaunchKey::kernel(11), LaunchKey::kernel(12));
    let seed = charge(&model, key, 1);
    model.record(&seed, 10 * US, Contention::Alone);
    let seed_other = charge(&model, other, 1);
    model.record(&seed_other, 10 * US, Contention::Alone);
    let mut batch = Batch::default();
    let launches: Vec<Charge> = (0..10).map(|_| model.charge(key, 2, &mut batch)).collect();
    let unsettled = &model.slots[seed.slot.unwrap()].unsettled;
    assert_eq!(
        unsettled.launches.load(Ordering::Relaxed),
        0,
        "all in the batch"
    );
    assert_eq!((batch.launches, batch.waves), (10, 20));
    // A failed launch comes back out of the batch that holds it.
    model.refund(&launches[9], &mut batch);
    assert_eq!((batch.launches, batch.waves), (9, 18));
    // A launch of another function adds the batch to its entry.
    model.charge(other, 1, &mut batch);
    assert_eq!(unsettled.launches.load(Ordering::Relaxed), 9);
    assert_eq!(unsettled.waves.load(Ordering::Relaxed), 18);
    assert_eq!(batch.launches, 1);
    // Its next measurement settles all nine at the measured price.
    let charged: u64 = launches[..9].iter().map(|charge| charge.ns).sum();
    let owed = model.record(&launches[0], 25 * US, Contention::Alone);
    let updated = price(&model, key, 2);
    assert_eq!(owed, 9 * signed(updated) - signed(charged));
    // A launch priced before its function was measured is not batched.
    let new = LaunchKey::kernel(14);
    let guess = model.charge(new, 1, &mut batch);
    assert!(guess.unmeasured);
    let entry = &model.slots[guess.slot.unwrap()].unsettled;
    assert_eq!(entry.launches.load(Ordering::Relaxed), 1);
    assert_eq!(batch.launches, 1, "the batch of the other function stays");
    // A batch is added at its bounds, in launches and in time.
    model.flush(&mut batch);
    assert_eq!(batch, Batch::default());
    for _ in 0..BATCH_LAUNCHES + 1 {
        model.charge(key, 1, &mut batch);
    }
    assert_eq!(batch.launches, 1, "{BATCH_LAUNCHES} launches were added");
    let long = LaunchKey::kernel(13);
    let seed = charge(&model, long, 1);
    model.record(&seed, BATCH_NS / 2, Contention::Alone);
    for _ in 0..3 {
        model.charge(long, 1, &mut batch);
    }
    assert_eq!(
        batch.launches, 1,
        "two were added once they held {BATCH_NS} ns"
    );
}

#[test]
fn a_lost_or_failed_launch_is_neither_measured_nor_settled() {
    let model = CostModel::default();
    let key = LaunchKey::graph(3);
    assert!(key.is_graph() && !LaunchKey::kernel(3).is_graph());
    let first = charge(&model, key, 1);
    model.abandon(&first);
    refund(&model, &first);
    let retry = charge(&model, key, 1);
    assert!(retry.wanted, "another launch takes the measurement");
    assert_eq!(retry.ahead, 0, "the failed launch is not counted ahead");
    assert_eq!(
        model.record(&retry, 40 * US, Contention::Alone),
        signed(20 * US)
    );
}

#[test]
fn a_function_measured_at_one_size_wants_its_next_other_size_measured() {
    let model = CostModel::default();
    let key = LaunchKey::kernel(0x3000);
    // A kernel of 1 µs a wave: measured at one wave, all of it is taken
    // as the fixed part, and ten waves would be priced as one.
    let first = charge(&model, key, 1);
    model.record(&first, US, Contention::Alone);
    // More launches at the measured size want nothing.
    assert!(!charge(&model, key, 1).wanted);
    // The first at another size is wanted, once while it is in flight.
    let other = charge(&model, key, 10);
    assert!(other.wanted && !other.unmeasured);
    assert_eq!(other.ns, US);
    assert!(!charge(&model, key, 5).wanted);
    // Measured, the fit holds two sizes: the launches charged meanwhile
    // (1 + 10 + 5 waves at 1 µs) are settled at the fitted price.
    let owed = model.record(&other, 10 * US, Contention::Alone);
    assert_eq!(owed, signed(16 * US) - signed(3 * US));
    assert_eq!(price(&model, key, 7), 7 * US);
    assert!(!charge(&model, key, 3).wanted);
}

#[test]
fn a_wanted_measurement_given_up_is_wanted_again() {
    let model = CostModel::default();
    let key = LaunchKey::kernel(0x4000);
    let first = charge(&model, key, 2);
    model.record(&first, 4 * US, Contention::Alone);
    let other = charge(&model, key, 4);
    assert!(other.wanted);
    model.abandon(&other);
    assert!(charge(&model, key, 6).wanted, "another launch takes it");
}
