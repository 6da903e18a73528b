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
//!   runtime's fat binaries) stays lazy: what its globals take is read from
//!   the image, and its first use in a context (the first launch of one of
//!   its kernels, a kernel's function, a module or global lookup) reserves
//!   that before the driver takes it, or is refused;
//! - the printf FIFO takes no device memory: measured, nothing charged;
//! - pools are charged what the driver says they reserve (see
//!   `quota::pools`): a trim, a threshold set or a pool destroyed settles
//!   their charge;
//! - calls that give memory back (unload, destroy, trims) measure again.
//!
//! Refusals return `CUDA_ERROR_OUT_OF_MEMORY` and leave the process as it
//! was before the call.

use super::super::room::{made_room, wants_room};
use crate::context::Context;
use crate::driver::Driver;
use crate::entry;
use crate::error::{LimiterError, Pass, Result};
use crate::grant::Grant;
use crate::quota::{FirstUse, MemoryQuota, Resource};
use crate::sys::{
    CU_LIMIT_MALLOC_HEAP_SIZE, CU_LIMIT_PRINTF_FIFO_SIZE, CU_LIMIT_STACK_SIZE, CUgraph, CUkernel,
    CUlibrary, CUlimit, CUmemoryPool, CUresult,
};

/// The quota and the context it answers in.
#[derive(Clone, Copy)]
pub(super) struct Held {
    quota: &'static MemoryQuota,
    ctx: &'static Context,
}

/// The policy, when limits are enforced, once the pod is on its GPUs: every
/// call here may take or give back device memory, so a swapped-out pod is
/// brought back first.
pub(super) fn held() -> Result<Held> {
    let limiter = entry::limiter().ok_or(LimiterError::Bypass(Pass::LimitsOff))?;
    limiter.resident();
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
            .ok_or(LimiterError::Bypass(Pass::DriverNotResolved))
    }

    /// `cuCtxSetLimit`: `set` sets the limit to the value it is given.
    pub(super) fn set_limit(
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
            return Err(LimiterError::Bypass(Pass::LimitHoldsNoMemory));
        }
        let device = self.current()?;
        let driver = self.driver()?;
        // Unknown: the whole new value is counted as growth.
        let old = driver.held.limit(limit).unwrap_or(0);
        if value <= old {
            return self.release(|| set(value));
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
    pub(super) fn load_module(
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
    pub(super) fn load_library_file(
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
                tracing::debug!(%error, "library left to load at its first use");
            }
            result
        };
        self.quota.measured(self.ctx, device, 0, load, unload)
    }

    /// A library from a memory image (`image`: its bytes, and whether they
    /// lie in a loaded object). Under lazy loading the load takes nothing
    /// on the device: the library is registered, its first use in a
    /// context reserved later ([`Self::first_use`]). Under eager loading
    /// it is measured like a module.
    pub(super) fn load_library_data(
        self,
        image: Option<(&'static [u8], bool)>,
        load: impl FnOnce() -> CUresult,
        loaded: impl FnOnce() -> CUlibrary,
        unload: impl FnOnce(),
    ) -> Result<CUresult> {
        if self.quota.eager_loading {
            return self.load_module(load, unload);
        }
        let result = load();
        if result.is_success()
            && let Some((bytes, mapped)) = image
        {
            self.quota.lazy.register(loaded() as usize, bytes, mapped);
        }
        Ok(result)
    }

    /// `op` may be `library`'s first use in the current context, which
    /// loads it there (a global's or its module's lookup, a kernel's
    /// function). A registered library's globals are reserved first, from
    /// its image; past the quota the call is refused before the driver
    /// takes anything. One not registered is measured: what it took stays
    /// until it is unloaded, and a use past the quota is refused.
    pub(super) fn first_use(
        self,
        library: CUlibrary,
        op: impl FnOnce() -> CUresult,
    ) -> Result<CUresult> {
        let device = self.current()?;
        match self.first_use_of(device, library)? {
            (context, FirstUse::Globals(bytes)) => {
                self.reserve_first_use(device, library, context, bytes, op)
            }
            (_, FirstUse::Nothing) => Err(LimiterError::Bypass(Pass::NothingToReserve)),
            (_, FirstUse::Unregistered) => self.quota.measured(self.ctx, device, 0, op, || {}),
        }
    }

    /// `cuKernelGetFunction`: the first use of `kernel`'s library here.
    pub(super) fn kernel_function(
        self,
        kernel: CUkernel,
        op: impl FnOnce() -> CUresult,
    ) -> Result<CUresult> {
        let library = self
            .driver()?
            .held
            .kernel_library(kernel)
            .map_err(|_| LimiterError::Bypass(Pass::NotLibraryKernel))?;
        self.first_use(library, op)
    }

    /// The first launch of `handle` seen: when it is a registered library's
    /// kernel whose first use in the current context is ahead, the library
    /// is loaded into the context now, its globals reserved, so that the
    /// launch takes nothing unreserved; past the quota the launch is
    /// refused. The handle is not looked at again once settled.
    pub(super) fn first_launch(
        self,
        handle: usize,
        driver_free: fn() -> Option<u64>,
    ) -> Result<()> {
        let lazy = &self.quota.lazy;
        let driver = self.driver()?;
        let Ok(library) = driver.held.kernel_library(handle as CUkernel) else {
            lazy.checked(handle); // a module's function: its module is loaded
            return Ok(());
        };
        let device = match self.current() {
            Ok(device) => device,
            Err(LimiterError::Bypass(_)) => {
                lazy.checked(handle);
                return Ok(());
            }
            Err(error) => return Err(error),
        };
        let (context, FirstUse::Globals(bytes)) = self.first_use_of(device, library)? else {
            lazy.checked(handle);
            return Ok(());
        };
        let load = || match driver.held.load_into_context(library) {
            Ok(()) => CUresult::SUCCESS,
            Err(error) => error.code(),
        };
        // A load the GPU has no room for, other pods filling it (many
        // loading at once), asks the hypervisor for room and is tried
        // again; a load that failed is the launch's to report.
        let mut rooms = 0;
        loop {
            let result = self.reserve_first_use(device, library, context, bytes, load)?;
            if result.is_success() {
                lazy.checked(handle);
                return Ok(());
            }
            if !(wants_room(result, rooms) && made_room(self.ctx, device, bytes, driver_free)) {
                return Ok(());
            }
            rooms += 1;
        }
    }

    /// The current context, and what `library`'s first use there (on
    /// `device`) takes.
    fn first_use_of(self, device: usize, library: CUlibrary) -> Result<(usize, FirstUse)> {
        let driver = self.driver()?;
        let context = driver
            .held
            .current_context()
            .map_err(|_| LimiterError::Bypass(Pass::NoCurrentContext))?
            as usize;
        let arch = driver.held.compute_capability(device as i32);
        let first_use = self.quota.lazy.first_use(library as usize, context, arch);
        Ok((context, first_use))
    }

    /// Reserves `bytes` for `library`'s first use in `context` (the current
    /// one), which `op` makes, and measures what it took.
    fn reserve_first_use(
        self,
        device: usize,
        library: CUlibrary,
        context: usize,
        bytes: u64,
        op: impl FnOnce() -> CUresult,
    ) -> Result<CUresult> {
        let result = self.quota.measured(self.ctx, device, bytes, op, || {})?;
        if result.is_success() {
            self.quota.lazy.used_in(library as usize, context);
        }
        Ok(result)
    }

    /// Unloads a library: its globals come back, its image is forgotten.
    pub(super) fn unload_library(
        self,
        library: CUlibrary,
        op: impl FnOnce() -> CUresult,
    ) -> Result<CUresult> {
        let result = self.release(op)?;
        if result.is_success() {
            self.quota.lazy.unregister(library as usize);
        }
        Ok(result)
    }

    /// Unloads a module: its globals come back, and its functions' handles
    /// may name another's functions from now on.
    pub(super) fn unload_module(self, op: impl FnOnce() -> CUresult) -> Result<CUresult> {
        let result = self.release(op)?;
        if result.is_success() {
            self.quota.lazy.forget_checked();
        }
        Ok(result)
    }

    /// A call that may give memory back, run by `op`.
    pub(super) fn release(self, op: impl FnOnce() -> CUresult) -> Result<CUresult> {
        let result = op();
        if result.is_success() {
            self.quota.remeasure(self.ctx);
        }
        Ok(result)
    }

    /// A call that may change what `pool` holds (a trim, an attribute):
    /// its charge follows.
    pub(super) fn pool_changed(
        self,
        pool: CUmemoryPool,
        op: impl FnOnce() -> CUresult,
    ) -> Result<CUresult> {
        let result = op();
        if result.is_success() {
            self.quota.settle_pool(self.ctx, pool);
            self.quota.remeasure(self.ctx);
        }
        Ok(result)
    }

    /// Destroys `pool`: what it keeps comes back, its live allocations stay
    /// charged until freed.
    pub(super) fn destroy_pool(
        self,
        pool: CUmemoryPool,
        destroy: impl FnOnce() -> CUresult,
    ) -> Result<CUresult> {
        let result = destroy();
        if result.is_success() {
            self.quota.end_pool(self.ctx, pool);
            self.quota.remeasure(self.ctx);
        }
        Ok(result)
    }

    /// Instantiates `graph`, charging what its allocation nodes will take
    /// on their devices; `made` names the exec once it is made.
    pub(super) fn instantiate(
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
            .map_err(|_| LimiterError::Bypass(Pass::GraphNotWalked))?;
        if allocations.by_device.is_empty() {
            return Err(LimiterError::Bypass(Pass::NoAllocationNodes));
        }
        let mut needs = Vec::with_capacity(allocations.by_device.len());
        for (device, bytes) in allocations.by_device {
            let device = match device {
                Some(device) => device,
                None => driver
                    .current_device()
                    .map_err(|_| LimiterError::Bypass(Pass::NoCurrentContext))?,
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
    pub(super) fn destroy_exec(
        self,
        exec: usize,
        destroy: impl FnOnce() -> CUresult,
    ) -> Result<CUresult> {
        let result = destroy();
        if result.is_success() {
            self.quota.end_graph(self.ctx, Resource::GraphExec(exec));
        }
        Ok(result)
    }
}
