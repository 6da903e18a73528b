//! Stream-ordered memory pools. A pool keeps what is freed into it, up to
//! its release threshold at each synchronisation and without bound between
//! them, so its allocations say little about its footprint. What is charged
//! for a pool is what the driver says it reserves on the device
//! (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`), freed memory it keeps
//! included, whatever its threshold:
//! - an allocation from a pool reserves its whole size first (the pool may
//!   have to grow by that much); when that does not fit, the pool gives back
//!   what it keeps unused (trimmed) and the allocation is tried once more,
//!   within the quota or refused. Once the driver allocated, the pool's
//!   charge becomes what it reserves now;
//! - a free into a pool changes nothing until the pool gives memory back: the
//!   charge follows the pool's reservation at the next allocation from it, a
//!   trim, a report, or before any allocation of the process is refused;
//! - a destroyed pool's allocations still live are charged as allocations
//!   of their own until freed.
//!
//! Allocations from pools carry no charge of their own: the pool's covers them.

use std::collections::HashMap;

use super::{Charge, MemoryQuota, Reservation, Resource, release};
use crate::context::Context;
use crate::sys::CUmemoryPool;

/// The pools this process allocated from and their live allocations.
#[derive(Default)]
pub(crate) struct Pools {
    /// Each pool's charge, by handle.
    charged: HashMap<usize, Charge>,
    /// Live allocations from pools: the pool and the size asked.
    pointers: HashMap<u64, (usize, u64)>,
}

impl MemoryQuota {
    /// Sets `pool`'s charge to what the driver says it reserves now; kept as
    /// it is when the driver cannot tell.
    pub(crate) fn settle_pool(&self, ctx: &'static Context, pool: CUmemoryPool) {
        let _change = self.change();
        if let Ok(mut pools) = self.pools.lock() {
            settle(ctx, &mut pools, pool as usize);
        }
    }

    /// Settles every pool of this process ([`Self::settle_pool`]).
    pub(crate) fn settle_pools(&self, ctx: &'static Context) {
        let _change = self.change();
        if let Ok(mut pools) = self.pools.lock() {
            let handles: Vec<usize> = pools.charged.keys().copied().collect();
            for pool in handles {
                settle(ctx, &mut pools, pool);
            }
        }
    }

    /// Whether this process charges any pool.
    pub(crate) fn has_pools(&self) -> bool {
        self.pools
            .lock()
            .is_ok_and(|pools| !pools.charged.is_empty())
    }

    /// Keeps an accepted reservation as part of `pool`'s charge, for the
    /// allocation at `pointer` the driver made from it, then settles the
    /// pool: its charge becomes what it reserves now. Where it cannot be the
    /// pool's, the reservation stays the allocation's own charge.
    pub(crate) fn commit_to_pool(
        &self,
        ctx: &'static Context,
        mut reservation: Reservation<'_>,
        pool: CUmemoryPool,
        pointer: u64,
    ) {
        let Ok(mut pools) = self.pools.lock() else {
            return reservation.commit(Resource::Pointer(pointer));
        };
        let charge = reservation.charge;
        let held = pools.charged.entry(pool as usize).or_insert(Charge {
            device: charge.device,
            bytes: 0,
        });
        if held.device != charge.device {
            // A pool lives on one device: this one is charged elsewhere.
            drop(pools);
            return reservation.commit(Resource::Pointer(pointer));
        }
        held.bytes = held.bytes.saturating_add(charge.bytes);
        reservation.charge.bytes = 0;
        pools
            .pointers
            .insert(pointer, (pool as usize, charge.bytes));
        settle(ctx, &mut pools, pool as usize);
    }

    /// The pool `pointer` was allocated from, if it was.
    pub(crate) fn pool_of(&self, pointer: u64) -> Option<CUmemoryPool> {
        let pools = self.pools.lock().ok()?;
        pools
            .pointers
            .get(&pointer)
            .map(|&(pool, _)| pool as CUmemoryPool)
    }

    /// After the free of `pointer` from `pool`: the allocation is gone, and
    /// the pool may hold less.
    pub(crate) fn freed_from_pool(&self, ctx: &'static Context, pointer: u64, pool: CUmemoryPool) {
        let _change = self.change();
        if let Ok(mut pools) = self.pools.lock() {
            pools.pointers.remove(&pointer);
            settle(ctx, &mut pools, pool as usize);
        }
    }

    /// After `pool` was destroyed: its allocations still live keep their
    /// memory (the driver frees the pool once they are freed), each charged
    /// on its own from now on; the rest of its charge is given back.
    pub(crate) fn end_pool(&self, ctx: &'static Context, pool: CUmemoryPool) {
        let _change = self.change();
        let (charge, live) = {
            let Ok(mut pools) = self.pools.lock() else {
                return;
            };
            let Some(charge) = pools.charged.remove(&(pool as usize)) else {
                return;
            };
            let live: Vec<(u64, u64)> = pools
                .pointers
                .iter()
                .filter(|(_, (owner, _))| *owner == pool as usize)
                .map(|(&pointer, &(_, bytes))| (pointer, bytes))
                .collect();
            for (pointer, _) in &live {
                pools.pointers.remove(pointer);
            }
            (charge, live)
        };
        let mut left = charge.bytes;
        for (pointer, bytes) in live {
            let bytes = bytes.min(left);
            left -= bytes;
            self.restore(
                Resource::Pointer(pointer),
                Charge {
                    device: charge.device,
                    bytes,
                },
            );
        }
        if let Some(ledger) = ctx.ledger() {
            release(ledger, charge.device, left);
        }
    }
}

/// Sets `pool`'s charge to what it reserves now: more is charged whatever
/// the quota (the driver holds it already: the next allocation is refused),
/// less is given back.
fn settle(ctx: &'static Context, pools: &mut Pools, pool: usize) {
    let Some(charge) = pools.charged.get_mut(&pool) else {
        return;
    };
    let (Some(ledger), Some(reserved)) = (
        ctx.ledger(),
        ctx.driver()
            .and_then(|driver| driver.held.pool_reserved(pool as CUmemoryPool)),
    ) else {
        return;
    };
    if reserved > charge.bytes {
        let more = reserved - charge.bytes;
        if let Err(error) = ledger.try_reserve_under(charge.device, more, 0) {
            tracing::warn!(pool, more, %error, "a pool's growth not charged");
            return;
        }
    } else {
        release(ledger, charge.device, charge.bytes - reserved);
    }
    tracing::trace!(pool, reserved, was = charge.bytes, "pool settled");
    charge.bytes = reserved;
}
