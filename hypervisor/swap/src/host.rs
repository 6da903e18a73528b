//! The host memory a swap-out needs, asked of the kernel before the driver
//! is.
//!
//! Measured on an H200 host (driver 580, 125 GiB, no swap space, `vm.
//! overcommit_memory = 1`) with `python3 -m scripts.bench checkpoint-limit`:
//! a checkpoint grows the process's resident memory by what it held on the
//! GPU, its context included (8, 24, 36, 39 and 41.5 GiB of tensors: 0.93
//! GiB more each time), in pageable memory that the kernel hands out
//! without asking. The driver does not check first: a checkpoint the host
//! cannot take would end with the kernel's out-of-memory killer choosing a
//! process. So a swap-out is refused up front, with the figures, when the
//! host's available memory less [`HOST_RESERVE`] cannot take it.

use std::path::Path;

/// Host memory a swap-out leaves to everything else on the node: the
/// daemon, the pods' own host memory, the page cache the node needs.
pub const HOST_RESERVE: u64 = 4 << 30;

/// Why the host cannot take a swap-out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "the host has {available} bytes of memory available; the pod's processes hold {need} on the GPU, which a checkpoint puts in host memory, and {reserve} stay for the rest of the node"
)]
pub struct HostShort {
    /// What the checkpoint would put in host memory.
    pub need: u64,
    /// `MemAvailable` of `/proc/meminfo`.
    pub available: u64,
    /// [`HOST_RESERVE`].
    pub reserve: u64,
}

/// Whether the host, with `available` bytes of memory available, takes a
/// swap-out of `need` bytes and keeps [`HOST_RESERVE`].
pub fn takes(need: u64, available: u64) -> Result<(), HostShort> {
    if need.saturating_add(HOST_RESERVE) <= available {
        return Ok(());
    }
    Err(HostShort {
        need,
        available,
        reserve: HOST_RESERVE,
    })
}

/// The host's available memory (`MemAvailable` of `/proc/meminfo`), in
/// bytes; `None` where the kernel does not say.
pub fn available() -> Option<u64> {
    available_in(Path::new("/proc/meminfo"))
}

fn available_in(meminfo: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(meminfo).ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut words = line.split_whitespace().skip(1);
    let kib: u64 = words.next()?.parse().ok()?;
    (words.next() == Some("kB")).then(|| kib.saturating_mul(1024))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn a_swap_out_needs_what_it_moves_and_the_reserve() {
        assert_eq!(takes(8 * GIB, 12 * GIB), Ok(()));
        assert_eq!(
            takes(8 * GIB, 12 * GIB - 1),
            Err(HostShort {
                need: 8 * GIB,
                available: 12 * GIB - 1,
                reserve: HOST_RESERVE
            })
        );
        assert!(takes(u64::MAX - 1, u64::MAX - 1).is_err(), "no overflow");
    }

    #[test]
    fn the_kernels_figure_is_read_in_bytes() {
        let dir = std::env::temp_dir().join(format!("host-meminfo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("meminfo");
        std::fs::write(
            &file,
            "MemTotal:       131981020 kB\nMemFree:        1000 kB\nMemAvailable:   130000000 kB\n",
        )
        .unwrap();
        assert_eq!(available_in(&file), Some(130_000_000 * 1024));
        std::fs::write(&file, "MemTotal: 1 kB\n").unwrap();
        assert_eq!(available_in(&file), None);
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(available().is_some_and(|bytes| bytes > 0));
    }
}
