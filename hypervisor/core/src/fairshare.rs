//! Weighted fair sharing of one GPU, as pure functions of the pods' limits
//! and which of them want the GPU now.
//!
//! Water-filling: every claimant `i` has a weight `wᵢ`, a floor `fᵢ` (its
//! guaranteed share) and a bound `bᵢ` (its cap). The GPU's capacity `C` (100%)
//! is split as `xᵢ = clamp(wᵢ·t, fᵢ, bᵢ)`, with the level `t` chosen so that
//! `Σ xᵢ = min(C, Σ bᵢ)`. A capped pod's unused share therefore goes to the
//! others in proportion to their weights, and floors are honoured first
//! (scaled down together if they oversubscribe the GPU).
//!
//! [`plan`] turns that into bucket settings: the pods that want the GPU split
//! it among themselves; an idle pod is given what it would get if every pod
//! wanted the GPU at once, so that it can start at once without taking more
//! than its fair share until the next tick.

use gpushare_utils::bucket::PPM;

use crate::spec::Policy;

/// The least rate a metered pod is given: a rate of 0 would mean "unlimited".
pub const MIN_RATE_PPM: u32 = 1_000;

/// One claimant of [`water_fill`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    /// At least 1 (0 counts as 1).
    pub weight: u32,
    /// Guaranteed part of the capacity, in ppm; floors that add up to more
    /// than the capacity are scaled down together.
    pub floor_ppm: u32,
    /// The most it may be given, in ppm (clipped to the capacity).
    pub bound_ppm: u32,
}

/// Splits `capacity` among `claims` (see the module documentation). The
/// result never sums above `capacity`; each entry lies within its floor
/// (after scaling) and its bound.
pub fn water_fill(claims: &[Claim], capacity: u32) -> Vec<u32> {
    if claims.is_empty() {
        return Vec::new();
    }
    let capacity_f = f64::from(capacity);
    let weights: Vec<f64> = claims.iter().map(|c| f64::from(c.weight.max(1))).collect();
    let bounds: Vec<f64> = claims
        .iter()
        .map(|c| f64::from(c.bound_ppm.min(capacity)))
        .collect();
    let mut floors: Vec<f64> = claims
        .iter()
        .zip(&bounds)
        .map(|(c, b)| f64::from(c.floor_ppm).min(*b))
        .collect();
    let floor_sum: f64 = floors.iter().sum();
    if floor_sum > capacity_f {
        let scale = capacity_f / floor_sum;
        floors.iter_mut().for_each(|f| *f *= scale);
    }
    let target = bounds.iter().sum::<f64>().min(capacity_f);
    let at = |t: f64| -> f64 {
        weights
            .iter()
            .zip(&floors)
            .zip(&bounds)
            .map(|((w, f), b)| (w * t).clamp(*f, *b))
            .sum()
    };
    // The allocation is piecewise linear in t, with corners where a claim
    // leaves its floor or reaches its bound: find the segment that reaches
    // the target and solve on it (exact, and cheap for the few pods of a GPU).
    let mut corners: Vec<f64> = weights
        .iter()
        .zip(floors.iter().zip(&bounds))
        .flat_map(|(w, (f, b))| [f / w, b / w])
        .collect();
    corners.sort_by(f64::total_cmp);
    let (mut lo, mut at_lo) = (0.0, at(0.0));
    let mut level = 0.0;
    if at_lo < target {
        level = corners.last().copied().unwrap_or(0.0);
        for &corner in corners.iter().filter(|&&c| c > 0.0) {
            let at_corner = at(corner);
            if at_corner >= target {
                let rise = at_corner - at_lo;
                level = if rise > 0.0 {
                    lo + (target - at_lo) * (corner - lo) / rise
                } else {
                    corner
                };
                break;
            }
            (lo, at_lo) = (corner, at_corner);
        }
    }
    let mut shares: Vec<u32> = weights
        .iter()
        .zip(&floors)
        .zip(&bounds)
        // A hair above the level, so that floating-point error cannot round a
        // share that should be whole down by one.
        .map(|((w, f), b)| (w * level + 1e-6).clamp(*f, *b).floor() as u32)
        .collect();
    // Rounding can leave a few ppm too many; take them from the largest.
    let mut total: u64 = shares.iter().map(|&s| u64::from(s)).sum();
    while total > u64::from(capacity) {
        let Some(max) = shares.iter_mut().max() else {
            break;
        };
        let cut = (total - u64::from(capacity)).min(u64::from(*max)) as u32;
        *max -= cut;
        total -= u64::from(cut);
    }
    shares
}

/// One pod's standing on one GPU, as [`plan`] needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// The pod's policy on the GPU: `none` is left unlimited and out of the
    /// split; `elastic` gets its bound as ceiling.
    pub policy: Policy,
    /// Its weight in the split, at least 1.
    pub weight: u32,
    /// Percent, 1..=100.
    pub bound_percent: u8,
    /// Percent, ≤ the bound.
    pub floor_percent: u8,
    /// It wants the GPU now (and is not suspended).
    pub active: bool,
}

/// What a pod's bucket is set to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Allotment {
    /// Share of wall time in ppm; 0 = unlimited (policy none).
    pub rate_ppm: u32,
    /// Elastic ceiling in ppm: the bound for elastic pods, the rate otherwise.
    pub ceiling_ppm: u32,
}

/// Bucket settings for every entry (same order). The pods split 100% of
/// the GPU's time; where `elastic_ppm` is more (a co-run GPU whose charges
/// overlap, see [`crate::scheduler`]), its excess goes to the elastic pods
/// alone, by weight within their caps: every other pod gets what it would
/// at 100%.
pub fn plan(entries: &[Entry], elastic_ppm: u32) -> Vec<Allotment> {
    let metered: Vec<usize> = (0..entries.len())
        .filter(|&i| entries[i].policy != Policy::None)
        .collect();
    let active: Vec<usize> = metered
        .iter()
        .copied()
        .filter(|&i| entries[i].active)
        .collect();
    let everyone = split(entries, &metered, elastic_ppm);
    let contending = split(entries, &active, elastic_ppm);
    let mut grants = vec![Allotment::default(); entries.len()];
    for (k, &i) in metered.iter().enumerate() {
        let share = match active.iter().position(|&a| a == i) {
            Some(pos) => contending[pos],
            None => everyone[k],
        };
        let rate = share.max(MIN_RATE_PPM);
        let ceiling = match entries[i].policy {
            Policy::Elastic => rate.max(percent_ppm(entries[i].bound_percent)),
            Policy::Fixed | Policy::None => rate,
        };
        grants[i] = Allotment {
            rate_ppm: rate,
            ceiling_ppm: ceiling,
        };
    }
    grants
}

/// The shares of `members` (indices into `entries`): [`water_fill`] of the
/// GPU's time, then, where `elastic_ppm` is more, of `elastic_ppm` with
/// every pod but the elastic ones held at its first share.
fn split(entries: &[Entry], members: &[usize], elastic_ppm: u32) -> Vec<u32> {
    let ppm = PPM as u32;
    let claim = |i: usize| Claim {
        weight: entries[i].weight,
        floor_ppm: percent_ppm(entries[i].floor_percent),
        bound_ppm: percent_ppm(entries[i].bound_percent),
    };
    let claims: Vec<Claim> = members.iter().map(|&i| claim(i)).collect();
    let shares = water_fill(&claims, ppm);
    let elastic = |i: usize| entries[i].policy == Policy::Elastic;
    if elastic_ppm <= ppm || !members.iter().any(|&i| elastic(i)) {
        return shares;
    }
    let held: Vec<Claim> = members
        .iter()
        .zip(claims.iter().zip(&shares))
        .map(|(&i, (claim, &share))| match elastic(i) {
            true => *claim,
            false => Claim {
                floor_ppm: share,
                bound_ppm: share,
                ..*claim
            },
        })
        .collect();
    water_fill(&held, elastic_ppm)
}

fn percent_ppm(percent: u8) -> u32 {
    u32::from(percent.min(100)) * 10_000
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(weight: u32, floor: u32, bound: u32) -> Claim {
        Claim {
            weight,
            floor_ppm: floor * 10_000,
            bound_ppm: bound * 10_000,
        }
    }

    fn percent(shares: &[u32]) -> Vec<f64> {
        shares
            .iter()
            .map(|&s| (f64::from(s) / 1_000.0).round() / 10.0)
            .collect()
    }

    #[test]
    fn water_fill_table() {
        let cases: &[(&[Claim], &[f64])] = &[
            (&[], &[]),
            (&[claim(1, 0, 100)], &[100.0]),
            (&[claim(1, 0, 100), claim(3, 0, 100)], &[25.0, 75.0]),
            (&[claim(1, 0, 100), claim(1, 0, 100)], &[50.0, 50.0]),
            // A capped pod's unused share goes to the others by weight.
            (&[claim(1, 0, 20), claim(1, 0, 100)], &[20.0, 80.0]),
            (
                &[claim(1, 0, 10), claim(1, 0, 100), claim(2, 0, 100)],
                &[10.0, 30.0, 60.0],
            ),
            // Everyone capped: the rest of the GPU stays idle.
            (&[claim(1, 0, 30), claim(1, 0, 30)], &[30.0, 30.0]),
            // Floors first.
            (&[claim(1, 50, 100), claim(3, 0, 100)], &[50.0, 50.0]),
            (&[claim(1, 10, 100), claim(3, 0, 100)], &[25.0, 75.0]),
            // Oversubscribed floors scale down together.
            (&[claim(1, 80, 100), claim(1, 40, 100)], &[66.7, 33.3]),
            // A weight of 0 counts as 1.
            (&[claim(0, 0, 100), claim(1, 0, 100)], &[50.0, 50.0]),
        ];
        for (claims, want) in cases {
            let got = water_fill(claims, PPM as u32);
            assert_eq!(&percent(&got), want, "{claims:?}");
            assert!(got.iter().map(|&s| u64::from(s)).sum::<u64>() <= PPM);
        }
    }

    #[test]
    fn water_fill_sums_to_capacity_under_random_claims() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..2000 {
            let n = (next() % 8 + 1) as usize;
            let claims: Vec<Claim> = (0..n)
                .map(|_| {
                    let bound = (next() % 100 + 1) as u32;
                    let floor = (next() % 101) as u32 % (bound + 1);
                    claim((next() % 10) as u32 + 1, floor, bound)
                })
                .collect();
            let got = water_fill(&claims, PPM as u32);
            let total: u64 = got.iter().map(|&s| u64::from(s)).sum();
            let bounds: u64 = claims.iter().map(|c| u64::from(c.bound_ppm)).sum();
            assert!(total <= PPM, "{claims:?} {got:?}");
            assert!(total + n as u64 >= bounds.min(PPM), "{claims:?} {got:?}");
            for (c, g) in claims.iter().zip(&got) {
                assert!(*g <= c.bound_ppm, "{claims:?} {got:?}");
            }
        }
    }

    fn entry(policy: Policy, weight: u32, bound: u8, floor: u8, active: bool) -> Entry {
        Entry {
            policy,
            weight,
            bound_percent: bound,
            floor_percent: floor,
            active,
        }
    }

    #[test]
    fn plan_weighted_both_active() {
        let grants = plan(
            &[
                entry(Policy::Fixed, 1, 100, 0, true),
                entry(Policy::Fixed, 3, 100, 0, true),
            ],
            PPM as u32,
        );
        assert_eq!(grants[0].rate_ppm, 250_000);
        assert_eq!(grants[1].rate_ppm, 750_000);
    }

    #[test]
    fn plan_elastic_takes_idle_time_fixed_does_not() {
        // The other pod idle: the fixed pod stays at its cap, the elastic one
        // takes the whole GPU.
        let fixed = plan(
            &[
                entry(Policy::Fixed, 1, 30, 0, true),
                entry(Policy::Fixed, 1, 100, 0, false),
            ],
            PPM as u32,
        );
        assert_eq!(fixed[0].rate_ppm, 300_000);
        assert_eq!(fixed[0].ceiling_ppm, 300_000);
        let elastic = plan(
            &[
                entry(Policy::Elastic, 1, 100, 30, true),
                entry(Policy::Fixed, 1, 100, 0, false),
            ],
            PPM as u32,
        );
        assert_eq!(elastic[0].rate_ppm, 1_000_000);
        // Contended, the elastic pod falls back to its fair share.
        let contended = plan(
            &[
                entry(Policy::Elastic, 1, 100, 30, true),
                entry(Policy::Fixed, 3, 100, 0, true),
            ],
            PPM as u32,
        );
        assert_eq!(contended[0].rate_ppm, 300_000);
        assert_eq!(contended[0].ceiling_ppm, 1_000_000);
        assert_eq!(contended[1].rate_ppm, 700_000);
    }

    #[test]
    fn plan_idle_pods_get_their_all_contending_share_and_none_is_unlimited() {
        let grants = plan(
            &[
                entry(Policy::Fixed, 1, 100, 0, true),
                entry(Policy::Fixed, 1, 100, 0, false),
                entry(Policy::None, 1, 100, 0, true),
            ],
            PPM as u32,
        );
        assert_eq!(grants[0].rate_ppm, 1_000_000);
        assert_eq!(grants[1].rate_ppm, 500_000);
        assert_eq!(grants[2], Allotment::default());
    }

    #[test]
    fn plan_never_grants_zero_to_a_metered_pod() {
        let grants = plan(
            &[
                entry(Policy::Fixed, 1, 100, 100, true),
                entry(Policy::Fixed, 1, 100, 0, true),
            ],
            PPM as u32,
        );
        assert_eq!(grants[0].rate_ppm, 1_000_000);
        assert_eq!(grants[1].rate_ppm, MIN_RATE_PPM);
    }

    #[test]
    fn plan_gives_capacity_above_the_gpu_to_elastic_pods_only() {
        let more = 1_200_000;
        let elastic = plan(
            &[
                entry(Policy::Elastic, 1, 100, 0, true),
                entry(Policy::Elastic, 3, 100, 0, true),
            ],
            more,
        );
        assert_eq!(elastic[0].rate_ppm, 300_000);
        assert_eq!(elastic[1].rate_ppm, 900_000);
        // A fixed pod keeps what it gets at 100%; a capped elastic pod its cap.
        let mixed = plan(
            &[
                entry(Policy::Fixed, 1, 100, 0, true),
                entry(Policy::Elastic, 1, 100, 0, true),
                entry(Policy::Elastic, 1, 20, 0, true),
            ],
            more,
        );
        let rates: Vec<u32> = mixed.iter().map(|g| g.rate_ppm).collect();
        assert_eq!(rates, [400_000, 600_000, 200_000]);
        // Without an elastic pod nothing changes.
        let fixed = [
            entry(Policy::Fixed, 1, 100, 0, true),
            entry(Policy::Fixed, 1, 100, 0, false),
        ];
        assert_eq!(plan(&fixed, more), plan(&fixed, PPM as u32));
    }
}
