//! Libraries the driver loads into a context only at their first use there
//! (lazy loading, the default): the CUDA runtime registers each translation
//! unit's fat binary with `cuLibraryLoadData`, and the driver takes the
//! library's `__device__` globals at the first launch of one of its kernels
//! in a context. What they take is read from the image
//! ([`crate::image::globals`]) so that the first use can be reserved, or
//! refused, before the driver takes it; what a first use takes cannot be
//! given back before the library is unloaded.
//!
//! Launches look up their handle in a small lock-free table of handles
//! already checked; a handle missing from it is checked once, off the fast
//! path.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::image;

/// Libraries whose globals take less than this are not reserved before
/// their first use: the next measurement charges them (NVML is not called
/// at the first launch of every small library a framework registers).
pub(super) const RESERVED_GLOBALS: u64 = 1 << 20;
/// Handles the checked table holds (a power of two).
const SLOTS: usize = 1 << 14;
/// A full table checks no new handle: beyond this many, launches stop
/// looking (the periodic measurement still charges what a first use took).
const MAX_CHECKED: usize = SLOTS / 4 * 3;
/// Slots probed for a handle before it counts as missing.
const PROBES: usize = 16;
/// Images copied at registration are at most this large; a larger one not
/// in a mapped object is left to the measurement.
const MAX_COPIED_IMAGE: usize = 64 << 20;

/// Where a registered library's image is read from at its first use.
enum Source {
    /// In a loaded object's mapped file (the runtime's fat binaries): valid
    /// until the library is unloaded, which the runtime does before the
    /// object is unmapped.
    Mapped(&'static [u8]),
    /// Copied at registration (the caller may free its own buffer).
    Copied(Box<[u8]>),
}

impl Source {
    fn bytes(&self) -> &[u8] {
        match self {
            Self::Mapped(bytes) => bytes,
            Self::Copied(bytes) => bytes,
        }
    }
}

struct Library {
    source: Source,
    /// Globals by compute capability, read once each.
    globals: Vec<(u32, Option<u64>)>,
    /// Contexts its first use was reserved in.
    contexts: Vec<usize>,
}

/// What a library's first use in a context takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FirstUse {
    /// Not a library registered from an image: what it takes is unknown.
    Unregistered,
    /// Nothing to reserve: already used in the context, or globals below
    /// [`RESERVED_GLOBALS`] (or unreadable, or the device's architecture
    /// unknown).
    Nothing,
    /// Its globals, to reserve before the load.
    Globals(u64),
}

/// The process's lazily loaded libraries and the launch handles checked.
pub(crate) struct LazyLibraries {
    libraries: Mutex<HashMap<usize, Library>>,
    /// How many libraries are registered: launches look no further while none is.
    registered: AtomicUsize,
    checked: Box<[AtomicUsize]>,
    checked_len: AtomicUsize,
}

impl Default for LazyLibraries {
    fn default() -> Self {
        Self {
            libraries: Mutex::new(HashMap::new()),
            registered: AtomicUsize::new(0),
            checked: (0..SLOTS).map(|_| AtomicUsize::new(0)).collect(),
            checked_len: AtomicUsize::new(0),
        }
    }
}

impl LazyLibraries {
    /// Whether a launch of `handle` must be checked first: a library is
    /// registered and the handle was not checked yet.
    #[inline(always)]
    pub(crate) fn unchecked(&self, handle: usize) -> bool {
        self.registered.load(Ordering::Relaxed) != 0
            && handle != 0
            && !self.is_checked(handle)
            && self.checked_len.load(Ordering::Relaxed) < MAX_CHECKED
    }

    #[inline(always)]
    fn is_checked(&self, handle: usize) -> bool {
        let start = slot(handle);
        for probe in 0..PROBES {
            match self.checked[(start + probe) % SLOTS].load(Ordering::Relaxed) {
                0 => return false,
                seen if seen == handle => return true,
                _ => {}
            }
        }
        false
    }

    /// Marks `handle` checked: its launches look no further.
    pub(crate) fn checked(&self, handle: usize) {
        let start = slot(handle);
        for probe in 0..PROBES {
            let cell = &self.checked[(start + probe) % SLOTS];
            match cell.compare_exchange(0, handle, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => {
                    self.checked_len.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                Err(seen) if seen == handle => return,
                Err(_) => {}
            }
        }
        // No free slot near: the table counts as full for this handle's
        // neighbourhood; it stays unchecked (checked again, harmlessly).
    }

    /// Forgets every checked handle: an unload may free handles the driver
    /// hands out again for another library's kernels.
    pub(crate) fn forget_checked(&self) {
        for cell in &self.checked {
            cell.store(0, Ordering::Relaxed);
        }
        self.checked_len.store(0, Ordering::Relaxed);
    }

    /// Registers `library`, loaded from `image` (the bytes its headers
    /// span) which lies in a loaded object's mapping when `mapped`.
    pub(crate) fn register(&self, library: usize, image: &'static [u8], mapped: bool) {
        let source = if mapped {
            Source::Mapped(image)
        } else if image.len() <= MAX_COPIED_IMAGE {
            Source::Copied(image.into())
        } else {
            return;
        };
        let Ok(mut libraries) = self.libraries.lock() else {
            return;
        };
        let entry = Library {
            source,
            globals: Vec::new(),
            contexts: Vec::new(),
        };
        if libraries.insert(library, entry).is_none() {
            self.registered.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Forgets `library`, unloaded.
    pub(crate) fn unregister(&self, library: usize) {
        if let Ok(mut libraries) = self.libraries.lock()
            && libraries.remove(&library).is_some()
        {
            self.registered.fetch_sub(1, Ordering::Relaxed);
        }
        self.forget_checked();
    }

    /// What the first use of `library` in `context`, on a device of
    /// compute capability `arch` (`None`: unknown), takes.
    pub(crate) fn first_use(&self, library: usize, context: usize, arch: Option<u32>) -> FirstUse {
        let Ok(mut libraries) = self.libraries.lock() else {
            return FirstUse::Unregistered;
        };
        let Some(entry) = libraries.get_mut(&library) else {
            return FirstUse::Unregistered;
        };
        let Some(arch) = arch.filter(|_| !entry.contexts.contains(&context)) else {
            return FirstUse::Nothing;
        };
        let globals = match entry.globals.iter().find(|(a, _)| *a == arch) {
            Some(&(_, globals)) => globals,
            None => {
                let globals = image::globals(entry.source.bytes(), arch);
                tracing::debug!(library, arch, ?globals, "library image read");
                entry.globals.push((arch, globals));
                globals
            }
        };
        match globals {
            Some(bytes) if bytes >= RESERVED_GLOBALS => FirstUse::Globals(bytes),
            _ => FirstUse::Nothing,
        }
    }

    /// Notes that `library`'s first use in `context` was reserved and done.
    pub(crate) fn used_in(&self, library: usize, context: usize) {
        if let Ok(mut libraries) = self.libraries.lock()
            && let Some(entry) = libraries.get_mut(&library)
            && !entry.contexts.contains(&context)
        {
            entry.contexts.push(context);
        }
    }
}

/// The first slot probed for `handle` (handles are pointers: their low bits
/// carry little).
#[inline(always)]
fn slot(handle: usize) -> usize {
    ((handle as u64 >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - SLOTS.trailing_zeros()))
        as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fat-binary-free image: PTX declaring `bytes` of globals.
    fn ptx(bytes: u64) -> &'static [u8] {
        let text = format!(".version 9.0\n.target sm_90\n.global .align 1 .b8 g[{bytes}];\n");
        Box::leak(text.into_boxed_str()).as_bytes()
    }

    #[test]
    fn launches_are_checked_once_while_a_library_is_registered() {
        let lazy = LazyLibraries::default();
        assert!(
            !lazy.unchecked(0x1000),
            "nothing registered: nothing to check"
        );
        lazy.register(1, ptx(8 << 20), true);
        assert!(lazy.unchecked(0x1000));
        lazy.checked(0x1000);
        assert!(!lazy.unchecked(0x1000));
        assert!(lazy.unchecked(0x2000));
        lazy.unregister(1);
        lazy.register(2, ptx(8 << 20), false);
        assert!(lazy.unchecked(0x1000), "an unload forgets what was checked");
    }

    #[test]
    fn a_first_use_reserves_large_globals_once_per_context() {
        let lazy = LazyLibraries::default();
        lazy.register(1, ptx(8 << 20), true);
        lazy.register(2, ptx(4096), false);
        assert_eq!(lazy.first_use(1, 10, Some(90)), FirstUse::Globals(8 << 20));
        // Not done yet: asked again, the same answer.
        assert_eq!(lazy.first_use(1, 10, Some(90)), FirstUse::Globals(8 << 20));
        lazy.used_in(1, 10);
        assert_eq!(lazy.first_use(1, 10, Some(90)), FirstUse::Nothing);
        assert_eq!(lazy.first_use(1, 11, Some(90)), FirstUse::Globals(8 << 20));
        assert_eq!(
            lazy.first_use(2, 10, Some(90)),
            FirstUse::Nothing,
            "small globals"
        );
        assert_eq!(
            lazy.first_use(3, 10, Some(90)),
            FirstUse::Unregistered,
            "not registered"
        );
        assert_eq!(lazy.first_use(1, 12, None), FirstUse::Nothing, "no arch");
    }

    #[test]
    fn a_full_table_stops_checking_rather_than_checking_every_launch() {
        let lazy = LazyLibraries::default();
        lazy.register(1, ptx(8 << 20), true);
        for handle in 1..=MAX_CHECKED {
            lazy.checked(handle << 8);
        }
        assert!(!lazy.unchecked(usize::MAX << 8));
        assert!(lazy.checked_len.load(Ordering::Relaxed) >= MAX_CHECKED);
    }
}
