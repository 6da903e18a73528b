//! Which GPUs an MPS client is shown, by each party that shows them, and
//! whether they agree.
//!
//! An MPS server serves the GPUs of its control daemon's
//! `CUDA_VISIBLE_DEVICES` (the node daemon starts one per co-run GPU, on
//! that GPU alone), and its client's CUDA enumerates those alone. NVML knows
//! nothing of MPS: it shows every GPU of the node (of the container, where
//! the runtime gives it only its GPUs), and a program that counts GPUs
//! through NVML (PyTorch's `torch.cuda.device_count`, then checks every
//! device it counted) narrows that list only by `CUDA_VISIBLE_DEVICES`. On a
//! node of several GPUs a client whose variable does not name its server's
//! GPU is then shown GPUs CUDA does not have (measured: PyTorch fails in
//! its CUDA start-up with `device=1, num_gpus=1`). The pod's limits name the
//! GPUs the pod was given; a process that reaches fewer of them, or others,
//! is not where its pod was put. So after `cuInit` the three lists must be
//! one: CUDA's devices, NVML's GPUs under `CUDA_VISIBLE_DEVICES`, and,
//! where the hypervisor published limits, the pod's GPUs.

use std::fmt;

use gpushare_utils::limits::{PodLimits, uuid_key};

use crate::driver::{Driver, Nvml};

/// UUIDs, as a message lists them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Listed(pub Vec<String>);

impl fmt::Display for Listed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&self.0.join(","))
        }
    }
}

/// How the views of an MPS client disagree.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Disagreement {
    /// NVML, narrowed by `CUDA_VISIBLE_DEVICES`, shows other GPUs than CUDA.
    #[error(
        "NVML shows it GPUs {shown} (CUDA_VISIBLE_DEVICES {visible}) but its MPS server serves {served}: a program that counts GPUs through NVML (PyTorch) would use GPUs CUDA does not have; set CUDA_VISIBLE_DEVICES={served}"
    )]
    Nvml {
        /// What NVML shows under the variable.
        shown: Listed,
        /// CUDA's devices: the GPUs the server serves this client.
        served: Listed,
        /// The variable, quoted, or `unset`.
        visible: String,
    },
    /// The pod's limits name other GPUs than the client reaches.
    #[error(
        "its pod is given GPUs {given} but its MPS server serves {served}: one MPS server serves one co-run GPU, so a pod given a co-run GPU gets no other GPU, and its processes must be clients of that GPU's server"
    )]
    Given {
        /// The pod's GPUs (a GPU NVML does not show is named by its key).
        given: Listed,
        /// CUDA's devices.
        served: Listed,
    },
}

/// The GPUs one process is shown.
#[derive(Debug, Clone, Default)]
pub(crate) struct Views {
    /// CUDA's devices by ordinal (an MPS client: its server's GPUs).
    pub cuda: Vec<String>,
    /// Every GPU NVML shows, by NVML index; `None`: NVML cannot say (then
    /// neither can a program that counts through it, and PyTorch falls
    /// back to CUDA's count).
    pub nvml: Option<Vec<String>>,
    /// `CUDA_VISIBLE_DEVICES`.
    pub visible: Option<String>,
    /// The pod's GPUs by [`uuid_key`], as its published limits name them;
    /// `None`: none published (local limits name devices by index).
    pub given: Option<Vec<u64>>,
}

impl Views {
    /// What this process is shown now; `None` where CUDA cannot say which
    /// GPU one of its devices is.
    pub(crate) fn gather(
        driver: &Driver,
        nvml: Option<&Nvml>,
        limits: Option<&PodLimits>,
    ) -> Option<Self> {
        let count = driver.device_count()?;
        let cuda = (0..count)
            .map(|ordinal| driver.device_uuid(i32::try_from(ordinal).ok()?))
            .collect::<Option<Vec<_>>>()?;
        Some(Self {
            cuda,
            nvml: nvml.and_then(Nvml::device_uuids),
            visible: std::env::var("CUDA_VISIBLE_DEVICES").ok(),
            given: limits.map(given_keys),
        })
    }

    /// `Ok` when NVML (under the variable) and the pod's limits name
    /// exactly CUDA's devices.
    pub(crate) fn agree(&self) -> Result<(), Disagreement> {
        if let Some(nvml) = &self.nvml {
            let shown = shown_through_visible(self.visible.as_deref(), nvml);
            if !same_gpus(&shown, &self.cuda) {
                return Err(Disagreement::Nvml {
                    shown: Listed(shown),
                    served: Listed(self.cuda.clone()),
                    visible: self
                        .visible
                        .as_deref()
                        .map_or_else(|| "unset".to_owned(), |v| format!("{v:?}")),
                });
            }
        }
        if let Some(given) = &self.given {
            let mut reached: Vec<u64> = self.cuda.iter().map(|uuid| uuid_key(uuid)).collect();
            let mut wanted = given.clone();
            reached.sort_unstable();
            wanted.sort_unstable();
            if reached != wanted {
                return Err(Disagreement::Given {
                    given: Listed(given.iter().map(|key| self.name_of(*key)).collect()),
                    served: Listed(self.cuda.clone()),
                });
            }
        }
        Ok(())
    }

    /// The GPU of `key` by its UUID where NVML or CUDA shows it.
    fn name_of(&self, key: u64) -> String {
        self.nvml
            .iter()
            .flatten()
            .chain(&self.cuda)
            .find(|uuid| uuid_key(uuid) == key)
            .cloned()
            .unwrap_or_else(|| format!("(key {key:#x}, not on this node)"))
    }
}

/// The keys of the GPUs `limits` name.
fn given_keys(limits: &PodLimits) -> Vec<u64> {
    limits
        .region()
        .gpus
        .iter()
        .map(|gpu| gpu.key.load(std::sync::atomic::Ordering::Acquire))
        .filter(|key| *key != 0)
        .collect()
}

/// NVML's GPUs (`nvml`, by NVML index) that `CUDA_VISIBLE_DEVICES` names,
/// in its order, as NVML-counting programs read it: an index is an NVML
/// index, anything else a UUID prefix that names one GPU alone; the list
/// ends at the first empty entry or one that names no GPU, as CUDA's does.
/// Unset: every GPU.
pub(crate) fn shown_through_visible(visible: Option<&str>, nvml: &[String]) -> Vec<String> {
    let Some(visible) = visible else {
        return nvml.to_vec();
    };
    let mut shown = Vec::new();
    for entry in visible.split(',').map(str::trim) {
        let found = match entry.parse::<usize>() {
            Ok(index) => nvml.get(index),
            Err(_) if entry.is_empty() => None,
            Err(_) => {
                let mut matching = nvml.iter().filter(|uuid| {
                    uuid.get(..entry.len())
                        .is_some_and(|prefix| prefix.eq_ignore_ascii_case(entry))
                });
                matching.next().filter(|_| matching.next().is_none())
            }
        };
        let Some(uuid) = found else { break };
        shown.push(uuid.clone());
    }
    shown
}

/// Whether two lists name the same GPUs in the same order.
fn same_gpus(a: &[String], b: &[String]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.eq_ignore_ascii_case(y))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPU0: &str = "GPU-00000000-1111-2222-3333-444444444444";
    const GPU1: &str = "GPU-11111111-1111-2222-3333-444444444444";

    fn node() -> Vec<String> {
        vec![GPU0.to_owned(), GPU1.to_owned()]
    }

    #[test]
    fn the_variable_narrows_nvml_as_cuda_reads_it() {
        let nvml = node();
        let shown = |v: Option<&str>| shown_through_visible(v, &nvml);
        assert_eq!(shown(None), node());
        assert_eq!(shown(Some("1")), [GPU1]);
        assert_eq!(shown(Some("1,0")), [GPU1, GPU0]);
        assert_eq!(shown(Some("gpu-1111")), [GPU1]);
        assert_eq!(shown(Some(" GPU-0 , 1")), [GPU0, GPU1]);
        // A prefix of both names neither; the list ends there.
        assert_eq!(shown(Some("GPU-,0")), Vec::<String>::new());
        // An index past the end, an empty or unknown entry end the list.
        assert_eq!(shown(Some("0,7,1")), [GPU0]);
        assert_eq!(shown(Some(",1")), Vec::<String>::new());
        assert_eq!(shown(Some("MIG-1")), Vec::<String>::new());
    }

    fn views(cuda: &[&str], visible: Option<&str>, given: Option<&[&str]>) -> Views {
        Views {
            cuda: cuda.iter().map(|s| (*s).to_owned()).collect(),
            nvml: Some(node()),
            visible: visible.map(str::to_owned),
            given: given.map(|g| g.iter().map(|uuid| uuid_key(uuid)).collect()),
        }
    }

    #[test]
    fn a_client_of_gpu_1s_server_must_be_shown_gpu_1_alone() {
        // The failure measured on two GPUs: the variable unset, NVML shows
        // both, the server serves GPU 1.
        let unset = views(&[GPU1], None, None).agree().unwrap_err();
        assert!(matches!(unset, Disagreement::Nvml { .. }));
        let text = unset.to_string();
        assert!(
            text.contains(&format!("NVML shows it GPUs {GPU0},{GPU1}")),
            "{text}"
        );
        assert!(text.contains("CUDA_VISIBLE_DEVICES unset"), "{text}");
        assert!(
            text.ends_with(&format!("set CUDA_VISIBLE_DEVICES={GPU1}")),
            "{text}"
        );
        // Named by UUID (as the limiter pins it, as provisioning gives it).
        assert_eq!(views(&[GPU1], Some(GPU1), Some(&[GPU1])).agree(), Ok(()));
        // By index, NVML reads it as the node's GPU 0: not the same GPU.
        assert!(views(&[GPU1], Some("0"), None).agree().is_err());
        // NVML unavailable: nothing to disagree with.
        let mut blind = views(&[GPU1], None, None);
        blind.nvml = None;
        assert_eq!(blind.agree(), Ok(()));
        // One GPU on the node, its server's: agree with the variable unset.
        let mut one = views(&[GPU0], None, Some(&[GPU0]));
        one.nvml = Some(vec![GPU0.to_owned()]);
        assert_eq!(one.agree(), Ok(()));
    }

    #[test]
    fn a_pod_given_other_gpus_than_the_client_reaches_is_refused() {
        // Given a co-run GPU and an ordinary one: the client reaches one.
        let mixed = views(&[GPU1], Some(GPU1), Some(&[GPU0, GPU1]));
        let error = mixed.agree().unwrap_err();
        assert!(matches!(error, Disagreement::Given { .. }), "{error}");
        let text = error.to_string();
        assert!(
            text.contains(&format!(
                "given GPUs {GPU0},{GPU1} but its MPS server serves {GPU1}"
            )),
            "{text}"
        );
        // Given GPU 0, but a client of GPU 1's server.
        let elsewhere = views(&[GPU1], Some(GPU1), Some(&[GPU0]));
        assert!(matches!(elsewhere.agree(), Err(Disagreement::Given { .. })));
        // A GPU no list shows is named by its key.
        let gone = views(&[GPU1], Some(GPU1), Some(&["GPU-gone"]));
        let text = gone.agree().unwrap_err().to_string();
        assert!(text.contains("not on this node"), "{text}");
    }
}
