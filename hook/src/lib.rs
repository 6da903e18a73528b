//! The inline-hook engine, behind a narrow interface, and the runtime pieces
//! that generated detours use.
//!
//! The engine rewrites the first bytes of a function in memory into a jump to
//! a detour and returns a trampoline that runs the original. The default
//! backend is the `detour` crate (pure Rust on `iced-x86`): it relocates
//! RIP-relative prologues such as the driver's `cmp dword [rip+disp32], imm32`,
//! places trampolines and relays within ±2 GiB of the target, and, committed
//! as one [`detour::Transaction`] with `Threads::All`, suspends every other
//! thread and moves any thread caught inside the patched bytes. It was the only
//! crates.io engine that survived installation under concurrent calls
//! (ARCHITECTURE.md, "Why the hook engine"), so everything here goes through
//! one transaction.
//!
//! Generated detours (see `gpushare-macros`) hold their original in an
//! [`Original`] slot, describe themselves with a [`HookEntry`], and enter
//! through a [`DetourGuard`], which forwards to the original when the limiter
//! is off or when the limiter itself calls the driver from inside a detour.

pub mod thread_local;

use std::ffi::{CStr, c_void};
use std::fmt;
use std::marker::PhantomData;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use detour::{RawDetour, Threads, Transaction};

/// Why hooks could not be installed.
#[derive(Debug, thiserror::Error)]
pub enum HookError {
    /// A required symbol is not exported by the library.
    #[error("required symbol {symbol} not found")]
    MissingSymbol {
        /// The symbol's name.
        symbol: String,
    },
    /// The engine could not prepare a detour for this target.
    #[error("cannot detour {symbol} at {address:#x}: {source}")]
    Prepare {
        /// The patch's name (the exported symbol).
        symbol: String,
        /// Address of the function that could not be patched.
        address: usize,
        /// The engine's error.
        #[source]
        source: detour::Error,
    },
    /// The transaction that writes every patch at once failed; nothing was patched.
    #[error("patch transaction failed, nothing patched: {0}")]
    Commit(#[source] detour::Error),
}

/// One patch request: redirect `target` to `detour`.
#[derive(Debug, Clone, Copy)]
pub struct Patch {
    /// A name for messages (the exported symbol).
    pub name: &'static str,
    /// Address of the first instruction of the function to patch.
    pub target: *const (),
    /// Address of the function that replaces it.
    pub detour: *const (),
}

/// Detours live as long as the process: trampolines must stay valid for any
/// thread that may still be inside one.
struct LiveDetours(Vec<RawDetour>);

// SAFETY: the detours are never touched again after installation except to
// keep them alive; the raw pointers inside are addresses, not owned data.
unsafe impl Send for LiveDetours {}

static INSTALLED: Mutex<LiveDetours> = Mutex::new(LiveDetours(Vec::new()));

/// Patches every target in one transaction, with all other threads of the
/// process suspended, and returns the trampoline (callable original) of each,
/// in order. Either every patch is written or none is.
///
/// `before_commit` receives the trampolines before any patch is live, so
/// callers can publish them where the detours will look for them: a detour
/// may run on another thread the instant the transaction resumes it.
///
/// # Safety
///
/// Each `detour` must have exactly the signature and calling convention of
/// its `target`, and must stay valid for the life of the process.
pub unsafe fn replace_all(
    patches: &[Patch],
    before_commit: impl FnOnce(&[*const ()]),
) -> Result<Vec<*const ()>, HookError> {
    let mut detours = Vec::with_capacity(patches.len());
    for patch in patches {
        // SAFETY: forwarded from the caller: matching signatures.
        let prepared = unsafe { RawDetour::new(patch.target, patch.detour) }.map_err(|source| {
            HookError::Prepare {
                symbol: patch.name.to_owned(),
                address: patch.target as usize,
                source,
            }
        })?;
        detours.push(prepared);
    }
    let trampolines: Vec<*const ()> = detours.iter().map(RawDetour::trampoline).collect();
    before_commit(&trampolines);

    let mut transaction = Transaction::new();
    for prepared in &detours {
        transaction.enable(prepared);
    }
    // SAFETY: Threads::All suspends every other thread that can be suspended
    // and relocates any caught inside a prologue; threads that block the
    // suspend signal are libc helpers that never run driver code.
    unsafe { transaction.commit(Threads::All) }.map_err(HookError::Commit)?;

    // The patches are live: whatever happens, the detours must be kept, never
    // dropped (dropping unpatches without suspending threads, and the
    // caller would then clear original slots that running detours still
    // read). A poisoned lock only means an earlier panic while pushing; the
    // list itself is still a list.
    INSTALLED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .0
        .extend(detours);
    Ok(trampolines)
}

/// Patches one function; returns its callable original.
///
/// # Safety
///
/// See [`replace_all`].
pub unsafe fn replace(target: *const (), detour: *const ()) -> Result<*const (), HookError> {
    let patch = Patch {
        name: "function",
        target,
        detour,
    };
    // SAFETY: forwarded from the caller.
    let trampolines = unsafe { replace_all(&[patch], |_| {}) }?;
    Ok(trampolines[0])
}

/// The slot holding a detour's original function, typed by its signature.
pub struct Original<F> {
    address: AtomicUsize,
    _signature: PhantomData<F>,
}

impl<F: Copy> Original<F> {
    /// An empty slot; filled when the detour is installed.
    pub const fn new() -> Self {
        const {
            assert!(
                size_of::<F>() == size_of::<usize>(),
                "F must be a function pointer"
            );
        }
        Self {
            address: AtomicUsize::new(0),
            _signature: PhantomData,
        }
    }

    /// The original function, once installed.
    #[inline(always)]
    pub fn get(&self) -> Option<F> {
        let address = self.address.load(Ordering::Acquire);
        if address == 0 {
            return None;
        }
        // SAFETY: only `set` writes the slot, with a trampoline produced for a
        // target of signature F (the macro pairs them), and F is pointer-sized.
        Some(unsafe { std::mem::transmute_copy::<usize, F>(&address) })
    }

    /// The untyped slot, for the install table.
    pub const fn raw(&self) -> &AtomicUsize {
        &self.address
    }
}

impl<F: Copy> Default for Original<F> {
    fn default() -> Self {
        Self::new()
    }
}

/// How a detour describes itself to the installer. One per declared detour,
/// generated by `gpushare_macros::detours!`, gathered in one table per API family.
pub struct HookEntry {
    /// The exported symbol whose code is patched.
    pub symbol: &'static CStr,
    /// Address of the generated `extern "C"` detour.
    pub detour: fn() -> *const (),
    /// Where the trampoline to the original goes.
    pub original: &'static AtomicUsize,
    /// Whether installation fails without it (else it is skipped, logged).
    pub required: bool,
}

impl fmt::Debug for HookEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HookEntry")
            .field("symbol", &self.symbol)
            .field("required", &self.required)
            .finish()
    }
}

/// What [`install_tables`] did.
#[derive(Debug, Default)]
pub struct InstallReport {
    /// Symbols patched.
    pub patched: Vec<&'static CStr>,
    /// Optional symbols the library does not export.
    pub missing_optional: Vec<&'static CStr>,
}

/// Installs every entry of `tables` whose symbol `resolve` finds, in one
/// transaction. A missing required symbol fails before anything is patched.
///
/// # Safety
///
/// `resolve` must return addresses of functions with the signature each entry
/// declares (the exported symbol of the library the tables were written for).
pub unsafe fn install_tables(
    tables: &[&[HookEntry]],
    resolve: impl Fn(&CStr) -> Option<*const c_void>,
) -> Result<InstallReport, HookError> {
    let mut report = InstallReport::default();
    let mut patches = Vec::new();
    let mut slots = Vec::new();
    for entry in tables.iter().flat_map(|table| table.iter()) {
        match resolve(entry.symbol) {
            Some(address) if entry.original.load(Ordering::Acquire) == 0 => {
                patches.push(Patch {
                    name: entry.symbol.to_str().unwrap_or("?"),
                    target: address.cast(),
                    detour: (entry.detour)(),
                });
                slots.push(entry.original);
                report.patched.push(entry.symbol);
            }
            // Already installed (a second dlopen of the same library).
            Some(_) => {}
            None if entry.required => {
                return Err(HookError::MissingSymbol {
                    symbol: entry.symbol.to_string_lossy().into_owned(),
                });
            }
            None => report.missing_optional.push(entry.symbol),
        }
    }
    if patches.is_empty() {
        return Ok(report);
    }
    let publish = |trampolines: &[*const ()]| {
        for (slot, trampoline) in slots.iter().zip(trampolines) {
            slot.store(*trampoline as usize, Ordering::Release);
        }
    };
    // SAFETY: forwarded from the caller; the detours are `extern "C"`
    // functions generated with the declared signatures.
    let result = unsafe { replace_all(&patches, publish) };
    if result.is_err() {
        // Nothing was patched: the trampolines are gone with the detours.
        for slot in &slots {
            slot.store(0, Ordering::Release);
        }
    }
    result.map(|_| report)
}

/// Whether detours apply their logic; off, every detour forwards to the original.
static ENABLED: AtomicBool = AtomicBool::new(false);

/// Turns the detours' logic on or off process-wide.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Release);
}

/// Whether the detours' logic is on.
pub fn is_enabled() -> bool {
    ENABLED.load(Ordering::Acquire)
}

crate::initial_exec_thread_local! {
    /// The thread runs detour logic (initial-exec: read on every launch).
    static INSIDE_DETOUR: bool;
}

/// Marks the current thread as running detour logic. While one is held, any
/// driver call the limiter makes that lands in another detour goes straight
/// to the original.
#[must_use = "the guard is released when dropped"]
pub struct DetourGuard {
    _not_send: PhantomData<*const ()>,
}

impl DetourGuard {
    /// Enters detour logic, or returns `None` to mean "call the original":
    /// the limiter is off, or this thread is already inside a detour.
    #[inline(always)]
    pub fn enter() -> Option<Self> {
        if !ENABLED.load(Ordering::Relaxed) {
            return None;
        }
        Self::enter_always()
    }

    /// Like [`enter`](Self::enter) but regardless of the process-wide switch:
    /// for the limiter's own work outside detours (installation, reports), so
    /// that the driver calls it makes go straight to the originals.
    #[inline(always)]
    pub fn enter_always() -> Option<Self> {
        INSIDE_DETOUR.with(|inside| {
            if inside.replace(true) {
                None
            } else {
                Some(Self {
                    _not_send: PhantomData,
                })
            }
        })
    }
}

impl Drop for DetourGuard {
    #[inline(always)]
    fn drop(&mut self) {
        INSIDE_DETOUR.with(|inside| inside.set(false));
    }
}

/// The value a detour returns in the one case it has no original to call
/// (never once installed: the slot is filled before the patch goes live).
pub trait Unavailable {
    /// An "unavailable" status of this return type.
    const UNAVAILABLE: Self;
}

/// What a detour's logic decided when it did not produce a return value.
pub enum Disposition<R> {
    /// Return this to the caller.
    Return(R),
    /// Run the original function with the caller's arguments.
    CallOriginal,
}

/// Turns a detour's typed error into what the caller sees. Implemented once
/// per error type and return type (`CUresult`, `nvmlReturn_t`).
pub trait IntoReturn<R> {
    /// The disposition for this error.
    fn into_return(self) -> Disposition<R>;
}

/// What an `around` handler (see `gpushare_macros::detours!`) hands its
/// detour when it lets a call through: the detour calls the original itself,
/// then gives this the result, which is what the caller gets.
pub trait AfterCall<R> {
    /// Runs once the original returned `result`.
    fn after(self, result: R);
}

static PANIC_REPORTED: AtomicBool = AtomicBool::new(false);

/// Reports, once per process, that detour logic panicked and the call fell
/// back to the original function.
#[cold]
pub fn report_panic(symbol: &str) {
    if !PANIC_REPORTED.swap(true, Ordering::Relaxed) {
        tracing::error!(
            symbol,
            "internal fault in a detour; calling the driver directly"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicU64;

    #[inline(never)]
    extern "C" fn add_one(x: u64) -> u64 {
        std::hint::black_box(x) + 1
    }

    static ADD_ONE_ORIGINAL: Original<extern "C" fn(u64) -> u64> = Original::new();

    extern "C" fn add_one_detour(x: u64) -> u64 {
        match ADD_ONE_ORIGINAL.get() {
            Some(original) => original(x) + 100,
            None => 0,
        }
    }

    #[test]
    fn installing_under_concurrent_calls_never_breaks_a_call() {
        let stop = Arc::new(AtomicBool::new(false));
        let calls = Arc::new(AtomicU64::new(0));
        let callers: Vec<_> = (0..3)
            .map(|_| {
                let stop = Arc::clone(&stop);
                let calls = Arc::clone(&calls);
                std::thread::spawn(move || {
                    let target: extern "C" fn(u64) -> u64 = std::hint::black_box(add_one);
                    while !stop.load(Ordering::Relaxed) {
                        let got = target(1);
                        assert!(got == 2 || got == 102, "bad result {got}");
                        calls.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        while calls.load(Ordering::Relaxed) < 1000 {
            std::thread::yield_now();
        }
        let entry = HookEntry {
            symbol: c"add_one",
            detour: || add_one_detour as *const (),
            original: ADD_ONE_ORIGINAL.raw(),
            required: true,
        };
        // SAFETY: the resolved address is `add_one`, whose signature the detour shares.
        let report = unsafe {
            install_tables(&[std::slice::from_ref(&entry)], |_| {
                Some(add_one as *const c_void)
            })
        }
        .expect("install");
        assert_eq!(report.patched, vec![c"add_one"]);
        let before = calls.load(Ordering::Relaxed);
        while calls.load(Ordering::Relaxed) < before + 1000 {
            std::thread::yield_now();
        }
        stop.store(true, Ordering::Relaxed);
        for caller in callers {
            caller.join().expect("caller thread");
        }
        let target: extern "C" fn(u64) -> u64 = std::hint::black_box(add_one);
        assert_eq!(target(1), 102);
        assert_eq!(ADD_ONE_ORIGINAL.get().expect("slot")(1), 2);
    }

    #[test]
    fn missing_required_symbol_patches_nothing() {
        static SLOT: Original<extern "C" fn(u64) -> u64> = Original::new();
        let entry = HookEntry {
            symbol: c"absent",
            detour: || add_one_detour as *const (),
            original: SLOT.raw(),
            required: true,
        };
        // SAFETY: nothing resolves, so nothing is patched.
        let result = unsafe { install_tables(&[std::slice::from_ref(&entry)], |_| None) };
        assert!(matches!(result, Err(HookError::MissingSymbol { .. })));
        assert!(SLOT.get().is_none());
    }

    #[test]
    fn guard_refuses_reentry_and_respects_switch() {
        set_enabled(false);
        assert!(DetourGuard::enter().is_none());
        let outer = DetourGuard::enter_always().expect("first entry");
        assert!(DetourGuard::enter_always().is_none());
        drop(outer);
        assert!(DetourGuard::enter_always().is_some());
    }
}
