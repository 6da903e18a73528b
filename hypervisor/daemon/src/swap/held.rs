//! What a swap-out puts in host memory: what the pod's proven processes
//! hold on the GPUs by the driver (NVML's per-process figures), raised to
//! the pod's ledger on a GPU where the ledger says more. A pod's own
//! figures may add to the count, never lower it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use hypervisor_core::scheduler::SwapView;

use crate::Hypervisor;

impl Hypervisor {
    /// The bytes the pod's proven processes `pids` hold on the node's GPUs:
    /// on each GPU, what NVML attributes to them, or what the pod's ledger
    /// says where that is more (NVML may not tell, or not yet).
    pub(super) async fn held_bytes(&self, view: &SwapView, pids: &[u32]) -> u64 {
        let seen = self.nvml_bytes(pids).await;
        let ledger: Vec<(&str, u64)> = view
            .gpus
            .iter()
            .map(|g| (g.uuid.as_str(), g.bytes))
            .collect();
        held(&ledger, &seen)
    }

    /// What NVML attributes to the processes `pids` on each GPU that
    /// answered, by lowercase UUID; empty where none did.
    pub(super) async fn nvml_bytes(&self, pids: &[u32]) -> BTreeMap<String, u64> {
        let observer = Arc::clone(&self.shared.observer);
        let pids: BTreeSet<u32> = pids.iter().copied().collect();
        tokio::task::spawn_blocking(move || {
            let mut seen = BTreeMap::new();
            for gpu in observer.gpus().unwrap_or_default() {
                match observer.process_memory(gpu.index) {
                    Ok(processes) => {
                        let bytes = processes
                            .iter()
                            .filter(|p| pids.contains(&p.pid))
                            .map(|p| p.bytes)
                            .fold(0, u64::saturating_add);
                        seen.insert(gpu.uuid.to_ascii_lowercase(), bytes);
                    }
                    Err(error) => {
                        tracing::debug!(%error, gpu = gpu.index, "no process memory; the ledger's figure stands");
                    }
                }
            }
            seen
        })
        .await
        .unwrap_or_default()
    }
}

/// The pod's bytes: on each GPU of `seen` (NVML's figure for its
/// processes, by lowercase UUID), that or its `ledger`'s figure (by UUID)
/// where that is more; on the GPUs NVML did not report, its ledger's.
fn held(ledger: &[(&str, u64)], seen: &BTreeMap<String, u64>) -> u64 {
    let on = |uuid: &str| {
        ledger
            .iter()
            .filter(|(gpu, _)| gpu.eq_ignore_ascii_case(uuid))
            .map(|(_, bytes)| *bytes)
            .fold(0, u64::saturating_add)
    };
    let observed = seen
        .iter()
        .map(|(uuid, &bytes)| bytes.max(on(uuid)))
        .fold(0, u64::saturating_add);
    let unobserved = ledger
        .iter()
        .filter(|(gpu, _)| !seen.contains_key(&gpu.to_ascii_lowercase()))
        .map(|(_, bytes)| *bytes)
        .fold(0, u64::saturating_add);
    observed.saturating_add(unobserved)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_driver_counts_and_the_ledger_only_adds() {
        let seen = |figures: &[(&str, u64)]| -> BTreeMap<String, u64> {
            figures.iter().map(|(g, b)| ((*g).to_owned(), *b)).collect()
        };
        // A ledger that says 1 byte where the processes hold 2 GiB.
        assert_eq!(held(&[("GPU-A", 1)], &seen(&[("gpu-a", 2 << 30)])), 2 << 30);
        // A ledger that says more than NVML stands.
        assert_eq!(held(&[("GPU-A", 5)], &seen(&[("gpu-a", 3)])), 5);
        // Memory on a GPU the pod is not placed on counts too; a GPU NVML
        // does not report counts by the ledger.
        assert_eq!(
            held(&[("GPU-A", 7)], &seen(&[("gpu-b", 4)])),
            11,
            "7 by the ledger on A, 4 by NVML on B"
        );
        assert_eq!(held(&[], &seen(&[])), 0);
    }
}
