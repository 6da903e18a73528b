//! `libcuda_limiter.so`: per-pod GPU memory quotas enforced from inside an
//! unmodified CUDA program, by inline-patching the driver.
//!
//! The life of a call:
//! 1. At load (`LD_PRELOAD`), the constructor reads the configuration
//!    from the environment ([`config`], parsed here: the local limits, the
//!    pod, the hypervisor's address) into the one [`entry`] state and its
//!    [`context`]. In a container the node daemon provisioned, the pod file
//!    beside the container's limiter ([`provisioned`]: the library
//!    `/etc/ld.so.preload` names, whatever name this one was loaded under)
//!    decides the pod, the daemon and the token, whatever the environment
//!    says; another copy of the limiter in the process stays off. No limit configured:
//!    nothing else happens. A broken configuration: one error line, and
//!    CUDA is refused at `cuInit`. A process that must be an MPS client is
//!    shown its server's GPU ([`mps`]).
//! 2. If libcuda / libnvidia-ml are already mapped they are patched at once;
//!    otherwise the exported `dlopen` ([`loader`]) patches them the moment a
//!    `dlopen` maps them, before that `dlopen` returns.
//! 3. Patching rewrites the first bytes of each exported entry point into a
//!    jump to a detour ([`detour`], generated per API family by
//!    `gpushare_macros::detours!`), all in one transaction with the other
//!    threads suspended. Every caller is caught: direct linking, `dlsym`,
//!    `cuGetProcAddress`, static or shared cudart, frameworks. A driver that
//!    cannot be patched gets `cuInit` alone patched, to refuse CUDA.
//! 4. `cuInit` decides where the limits come from ([`grant`]): under a
//!    hypervisor it waits, bounded, for the pod's read-only limits; without
//!    them, the local limits apply, or CUDA is refused. Never unlimited.
//! 5. A detour checks its guard (limiter on, not re-entered), then runs the
//!    family's logic. A call that needs the GPU first waits while the
//!    hypervisor has the pod swapped out ([`residency`]); an allocation
//!    then reserves its size in the pod's shared ledger ([`quota`]) before
//!    calling the original, and fails with `CUDA_ERROR_OUT_OF_MEMORY` if the
//!    pod would exceed its quota; a free credits it back; reports show the
//!    quota as total.
//! 6. Errors are typed ([`error`]) and become a `CUresult`/`nvmlReturn_t` in
//!    one place; "not ours to handle" calls the original; a panic is caught
//!    and falls back to the original.

// Unit tests build without the constructor and the exported `dlopen` (they
// would act inside the test binary), which leaves most entry paths unused.
#![cfg_attr(test, allow(dead_code))]

mod backing;
mod config;
mod context;
mod detour;
mod driver;
mod entry;
mod error;
mod grant;
mod hash;
mod hypervisor;
mod image;
mod loader;
mod metering;
mod mps;
mod provisioned;
mod quota;
mod residency;
mod spill;
mod sys;
mod throttle;
mod waves;

/// Load-time entry point. Kept cheap: a process that never loads CUDA pays
/// only for reading its environment and a few small files (the preload
/// file, a pod file).
#[cfg(not(test))]
#[ctor::ctor(unsafe)]
fn load() {
    let loaded = std::panic::catch_unwind(|| {
        gpushare_utils::logging::init("CUDA_LIMITER_LOG");
        if let entry::State::Limiting(limiter) = entry::init_from_env() {
            // SAFETY: before `main`: the program has started no thread that
            // reads the environment.
            unsafe { limiter.mps.pin_served_gpu(limiter.context.trust()) };
        }
        loader::install_if_mapped();
    });
    if loaded.is_err() {
        eprintln!("cuda-limiter: internal fault at load; limits may not apply");
    }
}
