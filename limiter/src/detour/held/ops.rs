//! Policy for device memory the driver takes for the process without an
//! allocation call, as measured on driver 580 (H100):
//! - thread stacks (`cuCtxSetLimit(CU_LIMIT_STACK_SIZE)`) and module globals
//!   (`cuModuleLoad*`) are taken by the call itself: reserved at an estimate
//!   (the stack for every resident thread; nothing for a module), measured
//!   right after, and undone and refused when the pod ends over its quota;
//! - the malloc heap is taken at the next launch: its growth is reserved at
//!   the call and held as pending until the process's footprint shows it;
//! - graph allocation nodes are taken at the exec's upload or first launch:
//!   their sizes are reserved at instantiation, held until the device's
//!   graph pool shows them, and an exec that does not fit is refused;
//! - a library's globals are taken when it is first used in a context: one
//!   loaded from a file is loaded into the current context at once, so
//!   measured and undone like a module; one from a memory image (the
//!   runtime's fat binaries) stays lazy: its load and the lookup of a
//!   global are measured, and a first use past the quota can only be
//!   refused, what it took staying held (and charged) until it is unloaded;
//! - the printf FIFO takes no device memory: measured, nothing charged;
//! - pools with a release threshold keep freed memory: after that, every
//!   free measures the process again at the next allocation;
//! - calls that give memory back (unload, destroy, trims) measure again.
//!
//! Refusals return `CUDA_ERROR_OUT_OF_MEMORY` and leave the process as it
//! was before the call.

use crate::context::Context;
use crate::driver::Driver;
use crate::entry;
use crate::error::{LimiterError, Result};
use crate::grant::Grant;
use crate::quota::{MemoryQuota, Resource};
use crate::sys::{
    CU_LIMIT_MALLOC_HEAP_SIZE, CU_LIMIT_PRINTF_FIFO_SIZE, CU_LIMIT_STACK_SIZE, CUgraph, CUlibrary,
    CUlimit, CUresult,
};

/// What a call that gives memory back changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    /// The driver may hold less now: measure again.
    Returned,
    /// A pool keeps freed memory from now on: frees measure again too.
    PoolsKeep,
}

/// The quota and the context it answers in.
#[derive(Clone, Copy)]
pub struct Held {
    quota: &'static MemoryQuota,
    ctx: &'static Context,
}

/// The policy, when limits are enforced.
pub fn held() -> Result<Held> {
    let limiter = entry::limiter().ok_or(LimiterError::Bypass("limits off"))?;
    Ok(Held {
        quota: &limiter.memory,
        ctx: &limiter.context,
    })
}

impl Held {
    /// The limited device of the calling thread's current context.
    fn current(self) -> Result<usize> {
        if matches!(self.ctx.grant(), Grant::Refused) {
            return Err(LimiterError::Misconfigured("no limits granted"));
        }
        self.quota.limited_device(self.ctx, None)
    }

    fn driver(self) -> Result<&'static Driver> {
        self.ctx
            .driver()
            .ok_or(LimiterError::Bypass("driver not resolved"))
    }

    /// `cuCtxSetLimit`: `set` sets the limit to the value it is given.
    pub fn set_limit(
        self,
        limit: CUlimit,
        value: usize,
        set: impl Fn(usize) -> CUresult,
    ) -> Result<CUresult> {
        if ![
            CU_LIMIT_STACK_SIZE,
            CU_LIMIT_MALLOC_HEAP_SIZE,
            CU_LIMIT_PRINTF_FIFO_SIZE,
        ]
        .contains(&limit)
        {
            return Err(LimiterError::Bypass("a limit that holds no memory"));
        }
        let device = self.current()?;
        let driver = self.driver()?;
        // Unknown: the whole new value is counted as growth.
        let old = driver.held.limit(limit).unwrap_or(0);
        if value <= old {
            return self.release(Effect::Returned, || set(value));
        }
        let growth = (value - old) as u64;
        let quota = self.quota;
        match limit {
            CU_LIMIT_MALLOC_HEAP_SIZE => quota.pending(self.ctx, device, growth, || set(value)),
            CU_LIMIT_STACK_SIZE => {
                let threads = driver.held.resident_threads(device as i32).unwrap_or(0);
                let estimate = growth.saturating_mul(threads);
                quota.measured(
                    self.ctx,
                    device,
                    estimate,
                    || set(value),
                    || {
                        let _ = set(old);
                    },
                )
            }
            // The FIFO is host memory on driver 580: measured, in case.
            _ => quota.measured(
                self.ctx,
                device,
                0,
                || set(value),
                || {
                    let _ = set(old);
                },
            ),
        }
    }

    /// A module load: its globals are taken by the call.
    pub fn load_module(
        self,
        load: impl FnOnce() -> CUresult,
        unload: impl FnOnce(),
    ) -> Result<CUresult> {
        let device = self.current()?;
        self.quota.measured(self.ctx, device, 0, load, unload)
    }

    /// A library loaded from a file, which the program names itself: it is
    /// loaded into the current context at once (`loaded` names it once
    /// `load` succeeded), so that its globals are measured, and undone past
    /// the quota, here rather than at a first use that could not be undone.
    /// Libraries from memory images (the runtime registers every fat binary
    /// of a program that way) stay lazy.
    pub fn load_library_file(
        self,
        load: impl FnOnce() -> CUresult,
        loaded: impl FnOnce() -> CUlibrary,
        unload: impl FnOnce(),
    ) -> Result<CUresult> {
        let device = self.current()?;
        let driver = self.driver()?;
        let load = || {
            let result = load();
            if result.is_success()
                && let Err(error) = driver.held.load_into_context(loaded())
            {
                tracing::debug!(code = error.0, "library left to load at its first use");
            }
            result
        };
        self.quota.measured(self.ctx, device, 0, load, unload)
    }

    /// A library's first use in the current context (a global's lookup):
    /// its globals may be taken now. Past the quota the lookup is refused;
    /// what the library took stays until it is unloaded, and is charged.
    pub fn first_use(self, op: impl FnOnce() -> CUresult) -> Result<CUresult> {
        let device = self.current()?;
        self.quota.measured(self.ctx, device, 0, op, || {})
    }

    /// A call that may give memory back, run by `op`.
    pub fn release(self, effect: Effect, op: impl FnOnce() -> CUresult) -> Result<CUresult> {
        let result = op();
        if result.is_success() {
            if effect == Effect::PoolsKeep {
                self.quota.pools_keep();
            }
            self.quota.remeasure(self.ctx);
        }
        Ok(result)
    }

    /// Instantiates `graph`, charging what its allocation nodes will take
    /// on their devices; `made` names the exec once it is made.
    pub fn instantiate(
        self,
        graph: CUgraph,
        instantiate: impl FnOnce() -> CUresult,
        made: impl FnOnce() -> usize,
    ) -> Result<CUresult> {
        if matches!(self.ctx.grant(), Grant::Refused) {
            return Err(LimiterError::Misconfigured("no limits granted"));
        }
        let driver = self.driver()?;
        // A graph the driver cannot walk is the driver's to refuse.
        let allocations = driver
            .held
            .graph_allocations(graph)
            .map_err(|_| LimiterError::Bypass("graph not walked"))?;
        if allocations.by_device.is_empty() {
            return Err(LimiterError::Bypass("no allocation nodes"));
        }
        let mut needs = Vec::with_capacity(allocations.by_device.len());
        for (device, bytes) in allocations.by_device {
            let device = match device {
                Some(device) => device,
                None => driver
                    .current_device()
                    .map_err(|_| LimiterError::Bypass("no current context"))?,
            };
            match self.quota.limited_device(self.ctx, Some(device)) {
                Ok(device) => needs.push((device, bytes)),
                Err(LimiterError::Bypass(_)) => {}
                Err(error) => return Err(error),
            }
        }
        let graphs = self.quota.graph_holds(self.ctx, &needs)?;
        let result = instantiate();
        if result.is_success() {
            graphs.commit(Resource::GraphExec(made()));
        }
        Ok(result)
    }

    /// Destroys a graph exec, ending its charge.
    pub fn destroy_exec(self, exec: usize, destroy: impl FnOnce() -> CUresult) -> Result<CUresult> {
        let result = destroy();
        if result.is_success() {
            self.quota.end_graph(self.ctx, Resource::GraphExec(exec));
        }
        Ok(result)
    }
}
