//! Which GPUs of the node a container gets: those its pod's annotations
//! allow, with enough free memory and compute after what the prepared
//! claims hold; the most used first (binpack) or the least used (spread).
//! The default scheduler only counted shares, so this is where memory
//! fragmentation across the node's GPUs is resolved, or the pod refused.
//! A GPU that overcommits offers more memory to quotas than it has (its
//! memory times the overcommit ratio), but never more than its own memory
//! to one container.
//!
//! A process is the MPS client of one co-run GPU, whose server sees no
//! other GPU: a container of several GPUs gets ordinary ones, and a pod
//! with a co-run GPU keeps all its containers on it (the provisioner
//! refuses any mix; here the mix is never picked).

use super::ask::{ContainerAsk, MemoryAsk, Packing, PodPrefs};

const MIB: u64 = 1 << 20;

/// A GPU of the node and what the prepared claims hold of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuLoad {
    /// NVML index; breaks ties between equally used GPUs, lowest first.
    pub index: u32,
    /// NVML UUID, matched against the pod's UUID annotations.
    pub uuid: String,
    /// Product name (`NVIDIA H100 80GB HBM3`), matched against the pod's
    /// GPU-type annotations.
    pub name: String,
    /// The GPU's memory in bytes: the most one container may get of it.
    pub memory_total: u64,
    /// The memory it offers to quotas, all containers together: its own,
    /// or more where it overcommits ([`hypervisor_provision::Provisioner::memory_capacity`]).
    pub memory_capacity: u64,
    /// Bytes of it the prepared claims hold ([`hypervisor_provision::Provisioner::held`]).
    pub memory_held: u64,
    /// Percent of its compute the prepared claims hold, added up.
    pub compute_held: u32,
    /// In co-run mode (its pods are MPS clients).
    pub corun: bool,
}

/// A GPU given to the container, and its part of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placed {
    /// NVML index: the grant's device is `gpu-<index>`.
    pub index: u32,
    /// NVML UUID.
    pub uuid: String,
    /// Memory quota in bytes: the ask's MiB, its percent of this GPU's
    /// memory, or the whole GPU's.
    pub memory_bytes: u64,
    /// Percent; 0 when the container has no compute limit.
    pub compute_percent: u8,
}

/// Why no placement: one line for the pod's event.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("container {container} asks for {asked}; {why}")]
pub struct Refusal {
    /// The container's name.
    pub container: String,
    /// What it asked, in words (`1 GPU(s) with 4096 MiB and 30% compute each`).
    pub asked: String,
    /// How many GPUs fit, and for each that does not, why: excluded by an
    /// annotation, co-run mode, or too little memory or compute free.
    pub why: String,
}

/// Places `ask` on `gpus`, for a pod whose other containers hold
/// `pod_gpus` (UUIDs).
pub fn place(
    ask: &ContainerAsk,
    prefs: &PodPrefs,
    gpus: &[GpuLoad],
    pod_gpus: &[String],
) -> Result<Vec<Placed>, Refusal> {
    let cores = u32::from(ask.cores.unwrap_or(0));
    let memory_of = |gpu: &GpuLoad| match ask.memory {
        MemoryAsk::Mib(mib) => mib.saturating_mul(MIB),
        MemoryAsk::Percent(p) => (u128::from(gpu.memory_total) * u128::from(p) / 100) as u64,
        MemoryAsk::Whole => gpu.memory_total,
    };
    let mut reasons = Vec::new();
    let mut fitting: Vec<&GpuLoad> = Vec::new();
    let held = |g: &&GpuLoad| pod_gpus.iter().any(|u| u.eq_ignore_ascii_case(&g.uuid));
    let pod_corun = gpus.iter().filter(held).find(|g| g.corun);
    let pod_ordinary = gpus.iter().filter(held).any(|g| !g.corun);
    for gpu in gpus {
        if !prefs.allows(&gpu.uuid, &gpu.name) {
            reasons.push(format!("{} excluded by the pod's annotations", label(gpu)));
            continue;
        }
        if let Some(why) = corun_excludes(gpu, ask, prefs, pod_corun, pod_ordinary) {
            reasons.push(format!("{} {why}", label(gpu)));
            continue;
        }
        if memory_of(gpu) > gpu.memory_total {
            reasons.push(format!(
                "{} has {} MiB of memory in all",
                label(gpu),
                gpu.memory_total / MIB
            ));
            continue;
        }
        let free_memory = gpu.memory_capacity.saturating_sub(gpu.memory_held);
        let free_compute = 100u32.saturating_sub(gpu.compute_held);
        if memory_of(gpu) > free_memory || cores > free_compute {
            reasons.push(format!(
                "{} has {} of {} MiB and {free_compute}% compute free",
                label(gpu),
                free_memory / MIB,
                gpu.memory_capacity / MIB
            ));
            continue;
        }
        fitting.push(gpu);
    }
    let used = |g: &GpuLoad| -> u64 {
        // Parts per 10,000 of memory plus of compute: the GPU's load.
        let memory = (g.memory_held.min(g.memory_capacity) as u128 * 10_000)
            .checked_div(g.memory_capacity as u128)
            .unwrap_or(0) as u64;
        memory + u64::from(g.compute_held.min(100)) * 100
    };
    match prefs.packing {
        Packing::Binpack => fitting.sort_by_key(|g| (std::cmp::Reverse(used(g)), g.index)),
        Packing::Spread => fitting.sort_by_key(|g| (used(g), g.index)),
    }
    if fitting.len() < ask.count as usize {
        return Err(Refusal {
            container: ask.container.clone(),
            asked: describe(ask),
            why: if reasons.is_empty() {
                format!("the node has {} GPUs", gpus.len())
            } else {
                format!(
                    "{} of the node's GPUs fit: {}",
                    fitting.len(),
                    reasons.join("; ")
                )
            },
        });
    }
    let mut placed: Vec<Placed> = fitting
        .into_iter()
        .take(ask.count as usize)
        .map(|g| Placed {
            index: g.index,
            uuid: g.uuid.clone(),
            memory_bytes: memory_of(g),
            compute_percent: cores as u8,
        })
        .collect();
    placed.sort_by_key(|p| p.index);
    Ok(placed)
}

/// Why co-run mode keeps `gpu` from `ask`, if it does.
fn corun_excludes(
    gpu: &GpuLoad,
    ask: &ContainerAsk,
    prefs: &PodPrefs,
    pod_corun: Option<&GpuLoad>,
    pod_ordinary: bool,
) -> Option<String> {
    match prefs.corun {
        Some(true) if !gpu.corun => return Some("is not a co-run GPU (gpushare.dev/corun)".into()),
        Some(false) if gpu.corun => return Some("is a co-run GPU (gpushare.dev/corun)".into()),
        _ => {}
    }
    if gpu.corun && ask.count > 1 {
        return Some("is a co-run GPU, and an MPS client sees one GPU alone".into());
    }
    if gpu.corun && pod_ordinary {
        return Some("is a co-run GPU, and the pod holds an ordinary one".into());
    }
    match pod_corun {
        Some(own) if own.uuid != gpu.uuid => Some(format!(
            "is not the co-run GPU the pod's other containers are MPS clients of ({})",
            own.uuid
        )),
        _ => None,
    }
}

fn label(gpu: &GpuLoad) -> String {
    format!("GPU {} ({})", gpu.index, gpu.uuid)
}

fn describe(ask: &ContainerAsk) -> String {
    let memory = match ask.memory {
        MemoryAsk::Mib(mib) => format!("{mib} MiB"),
        MemoryAsk::Percent(p) => format!("{p}% of the memory"),
        MemoryAsk::Whole => "all the memory".to_owned(),
    };
    let cores = ask
        .cores
        .map_or("no compute limit".to_owned(), |c| format!("{c}% compute"));
    format!("{} GPU(s) with {memory} and {cores} each", ask.count)
}

#[cfg(test)]
mod tests {
    use super::*;
    use hypervisor_core::spec::Policy;

    const GIB: u64 = 1 << 30;

    fn gpu(index: u32, held_gib: u64, compute: u32) -> GpuLoad {
        GpuLoad {
            index,
            uuid: format!("GPU-{index}"),
            name: "NVIDIA H100".into(),
            memory_total: 80 * GIB,
            memory_capacity: 80 * GIB,
            memory_held: held_gib * GIB,
            compute_held: compute,
            corun: false,
        }
    }

    fn ask(count: u32, memory: MemoryAsk, cores: Option<u8>) -> ContainerAsk {
        ContainerAsk {
            container: "main".into(),
            count,
            memory,
            cores,
        }
    }

    fn prefs(packing: Packing) -> PodPrefs {
        PodPrefs {
            use_uuids: vec![],
            nouse_uuids: vec![],
            use_types: vec![],
            nouse_types: vec![],
            packing,
            policy: Policy::Fixed,
            class: gpushare_utils::pod::PodClass::Batch,
            spill_bytes: 0,
            corun: None,
        }
    }

    #[test]
    fn table() {
        let node = [gpu(0, 10, 20), gpu(1, 70, 50), gpu(2, 0, 0)];
        let uuids = |r: Result<Vec<Placed>, Refusal>| -> Vec<u32> {
            r.map(|v| v.iter().map(|p| p.index).collect())
                .unwrap_or_default()
        };
        let mib = MemoryAsk::Mib(4096);
        // Binpack: the fullest GPU that fits; spread: the emptiest.
        assert_eq!(
            uuids(place(
                &ask(1, mib, Some(30)),
                &prefs(Packing::Binpack),
                &node,
                &[]
            )),
            [1]
        );
        assert_eq!(
            uuids(place(
                &ask(1, mib, Some(30)),
                &prefs(Packing::Spread),
                &node,
                &[]
            )),
            [2]
        );
        // 20 GiB does not fit where 70 of 80 are held: fragmentation resolved here.
        assert_eq!(
            uuids(place(
                &ask(1, MemoryAsk::Mib(20 * 1024), None),
                &prefs(Packing::Binpack),
                &node,
                &[]
            )),
            [0]
        );
        assert_eq!(
            uuids(place(
                &ask(2, MemoryAsk::Percent(50), Some(10)),
                &prefs(Packing::Binpack),
                &node,
                &[]
            )),
            [0, 2]
        );
        let mut only = prefs(Packing::Binpack);
        only.use_uuids = vec!["GPU-2".into()];
        assert_eq!(uuids(place(&ask(1, mib, None), &only, &node, &[])), [2]);
        // Whole GPUs: only the empty one.
        assert_eq!(
            uuids(place(
                &ask(1, MemoryAsk::Whole, Some(100)),
                &prefs(Packing::Binpack),
                &node,
                &[]
            )),
            [2]
        );
        let placed = place(
            &ask(1, MemoryAsk::Percent(25), Some(30)),
            &prefs(Packing::Spread),
            &node,
            &[],
        )
        .unwrap();
        assert_eq!(
            (placed[0].memory_bytes, placed[0].compute_percent),
            (20 * GIB, 30)
        );
    }

    #[test]
    fn refusal_says_why() {
        let node = [gpu(0, 78, 0), gpu(1, 0, 90)];
        let refused = place(
            &ask(1, MemoryAsk::Mib(4096), Some(30)),
            &prefs(Packing::Binpack),
            &node,
            &[],
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            refused,
            "container main asks for 1 GPU(s) with 4096 MiB and 30% compute each; 0 of the node's GPUs fit: \
             GPU 0 (GPU-0) has 2048 of 81920 MiB and 100% compute free; \
             GPU 1 (GPU-1) has 81920 of 81920 MiB and 10% compute free"
        );
        let refused = place(
            &ask(3, MemoryAsk::Mib(1), None),
            &prefs(Packing::Binpack),
            &node,
            &[],
        )
        .unwrap_err();
        assert_eq!(refused.why, "the node has 2 GPUs");
    }

    #[test]
    fn an_overcommitting_gpu_takes_more_containers_but_none_past_its_memory() {
        // GPU 0 overcommits at 1.5 (120 GiB offered) and holds 70 GiB.
        let mut node = [gpu(0, 70, 0), gpu(1, 70, 0)];
        node[0].memory_capacity = 120 * GIB;
        let placed = |memory: MemoryAsk| {
            place(&ask(1, memory, None), &prefs(Packing::Binpack), &node, &[]).map(|v| {
                v.iter()
                    .map(|p| (p.index, p.memory_bytes))
                    .collect::<Vec<_>>()
            })
        };
        // 40 GiB fits only where the GPU overcommits.
        assert_eq!(placed(MemoryAsk::Mib(40 * 1024)).unwrap(), [(0, 40 * GIB)]);
        // A share or the whole GPU is of its own memory, not of what it offers.
        assert_eq!(placed(MemoryAsk::Percent(50)).unwrap(), [(0, 40 * GIB)]);
        // Past the GPU's own memory: refused, however much it offers.
        let refused = placed(MemoryAsk::Mib(90 * 1024)).unwrap_err();
        assert!(
            refused
                .why
                .contains("GPU 0 (GPU-0) has 81920 MiB of memory in all"),
            "{refused}"
        );
        let mut empty = node.clone();
        empty[0].memory_held = 0;
        empty[0].memory_capacity = 160 * GIB;
        let refused = place(
            &ask(1, MemoryAsk::Mib(100 * 1024), None),
            &prefs(Packing::Binpack),
            &empty,
            &[],
        )
        .unwrap_err();
        assert!(
            refused.why.starts_with("0 of the node's GPUs fit"),
            "{refused}"
        );
    }

    #[test]
    fn co_run_gpus_are_never_mixed() {
        // GPU 1 is in co-run mode and the fullest: binpack's first choice.
        let mut node = [gpu(0, 10, 0), gpu(1, 40, 0), gpu(2, 0, 0)];
        node[1].corun = true;
        let indices = |r: Result<Vec<Placed>, Refusal>| -> Vec<u32> {
            r.map(|v| v.iter().map(|p| p.index).collect())
                .unwrap_or_default()
        };
        let mib = MemoryAsk::Mib(4096);
        let any = prefs(Packing::Binpack);
        assert_eq!(indices(place(&ask(1, mib, None), &any, &node, &[])), [1]);
        // Several GPUs: ordinary ones only.
        assert_eq!(indices(place(&ask(2, mib, None), &any, &node, &[])), [0, 2]);
        let refused = place(&ask(3, mib, None), &any, &node, &[]).unwrap_err();
        assert!(
            refused.why.contains("an MPS client sees one GPU alone"),
            "{refused}"
        );
        // The annotation picks the kind.
        let mut corun = prefs(Packing::Binpack);
        corun.corun = Some(true);
        assert_eq!(indices(place(&ask(1, mib, None), &corun, &node, &[])), [1]);
        corun.corun = Some(false);
        assert_eq!(indices(place(&ask(1, mib, None), &corun, &node, &[])), [0]);
        // A pod's containers stay on its co-run GPU, or off co-run GPUs.
        let on_corun = ["GPU-1".to_owned()];
        let mut spread = prefs(Packing::Spread);
        assert_eq!(
            indices(place(&ask(1, mib, None), &spread, &node, &on_corun)),
            [1]
        );
        let refused = place(
            &ask(1, MemoryAsk::Mib(50 * 1024), None),
            &spread,
            &node,
            &on_corun,
        )
        .unwrap_err();
        assert!(
            refused
                .why
                .contains("other containers are MPS clients of (GPU-1)"),
            "{refused}"
        );
        let on_ordinary = ["GPU-2".to_owned()];
        assert_eq!(
            indices(place(&ask(1, mib, None), &any, &node, &on_ordinary)),
            [0]
        );
        spread.corun = Some(true);
        let refused = place(&ask(1, mib, None), &spread, &node, &on_ordinary).unwrap_err();
        assert!(
            refused.why.contains("the pod holds an ordinary one"),
            "{refused}"
        );
    }
}
