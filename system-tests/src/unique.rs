//! Names no other test of this process, nor a test process running beside
//! it, takes: for folders, pods and shared objects.

use std::sync::atomic::{AtomicU32, Ordering};

/// `<prefix>-<pid>-<n>`, with `n` counted across the whole process.
pub fn name(prefix: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn two_names_of_one_prefix_differ_and_carry_the_pid() {
        let (a, b) = (super::name("x"), super::name("x"));
        assert_ne!(a, b);
        let pid = std::process::id().to_string();
        for n in [&a, &b] {
            let parts: Vec<&str> = n.split('-').collect();
            assert_eq!(parts[..2], ["x", pid.as_str()], "{n}");
            assert!(parts[2].parse::<u32>().is_ok(), "{n}");
        }
    }
}
