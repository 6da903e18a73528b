//! The daemon's turn plan in the node's priority table: the lines of the
//! GPUs that take turns are claimed and set when the plan is given and at
//! every check, what pods write there is set back, a table made again gets
//! its lines again, and a GPU that takes turns by itself does so while
//! capped pods contend for it.

use std::time::{Duration, Instant};

use gpushare_utils::limits::uuid_key;
use gpushare_utils::node_table::NodeTableNames;
use gpushare_utils::priority::TurnLine;
use gpushare_utils::shm;
use hypervisor_core::node_tables::NodeTables;
use hypervisor_core::region::RegionOptions;
use hypervisor_core::turns::{TurnOptions, TurnPlan};
use hypervisor_observer::{GpuInfo, GpuObserver, SimulatedGpus};

/// A test's table names, their objects removed on drop.
struct Names(NodeTableNames);

impl Names {
    fn new(test: &str) -> Self {
        let id = format!("{}-{test}", std::process::id());
        Self(NodeTableNames {
            activity: format!("gpushare-node-test-turns-{id}"),
            priority: format!("gpushare-priority-test-turns-{id}"),
        })
    }

    /// The node tables, made by this process as the daemon makes them.
    fn tables(&self) -> NodeTables {
        let regions = RegionOptions {
            mode: Some(0o600),
            uid: None,
            gid: None,
        };
        NodeTables::create(&self.0, &regions)
    }
}

impl Drop for Names {
    fn drop(&mut self) {
        let _ = shm::unlink(&self.0.activity);
        let _ = shm::unlink(&self.0.priority);
    }
}

/// The turn's length GPU `gpu`'s line says, ns; `None` without a line.
fn quantum(tables: &NodeTables, gpus: &[GpuInfo], gpu: usize) -> Option<u64> {
    let priority = tables.priority.as_ref().expect("priority table");
    priority
        .turn_line(uuid_key(&gpus[gpu].uuid))
        .map(TurnLine::quantum_ns)
}

/// The turn's length every GPU's line says, ns, by GPU.
fn quanta(tables: &NodeTables, gpus: &[GpuInfo]) -> Vec<Option<u64>> {
    (0..gpus.len()).map(|g| quantum(tables, gpus, g)).collect()
}

/// Whether each GPU takes turns now, and whether by itself, as the status
/// says.
fn turn_modes(tables: &NodeTables) -> Vec<(bool, bool)> {
    let status = tables
        .turns()
        .status(tables.priority.as_ref(), 1_000_000_000, |_| None);
    status
        .iter()
        .map(|g| (g.takes_turns, g.automatic))
        .collect()
}

#[test]
fn the_plan_sets_the_turns_gpus_lines_and_sets_back_what_pods_write() {
    let names = Names::new("plan");
    let mut tables = names.tables();
    let gpus = SimulatedGpus::new(3).gpus().expect("gpus");
    let priority = tables.priority.as_ref().expect("priority table");
    // A pod made GPU 2 take turns before the daemon's plan.
    let planted = priority
        .claim_turn_line(uuid_key(&gpus[2].uuid))
        .expect("line");
    planted.set_quantum_us(3_000);
    // GPU 0 named in another case than the observer's.
    let options = TurnOptions {
        gpus: vec![gpus[0].uuid.to_lowercase()],
        auto_gpus: Vec::new(),
        quantum_us: 7_000,
    };
    tables.set_turns(TurnPlan::new(&gpus, Some(&options)));
    let said = |tables: &NodeTables| quanta(tables, &gpus);
    assert_eq!(said(&tables), [Some(7_000_000), None, Some(0)]);

    // Pods drop GPU 0's turns and give GPU 2 some again: the check sets
    // both back.
    let priority = tables.priority.as_ref().expect("priority table");
    priority
        .turn_line(uuid_key(&gpus[0].uuid))
        .expect("line")
        .set_quantum_us(0);
    planted.set_quantum_us(100);
    tables.check();
    assert_eq!(said(&tables), [Some(7_000_000), None, Some(0)]);

    let priority = tables.priority.as_ref();
    let status = tables.turns().status(priority, 1_000_000_000, |_| None);
    let takes: Vec<_> = status
        .iter()
        .map(|g| (g.index, g.takes_turns, g.quantum_us))
        .collect();
    assert_eq!(takes, [(0, true, 7_000), (1, false, 0), (2, false, 0)]);
    assert_eq!(status[0].gpu, gpus[0].uuid);
    assert_eq!(
        (status[0].holder.as_deref(), status[0].holder_key),
        (None, 0)
    );
}

#[test]
fn a_table_made_again_gets_its_turn_lines_again() {
    let names = Names::new("remade");
    let mut tables = names.tables();
    let gpus = SimulatedGpus::new(2).gpus().expect("gpus");
    let options = TurnOptions {
        gpus: vec![gpus[1].uuid.clone()],
        auto_gpus: Vec::new(),
        quantum_us: 4_000,
    };
    tables.set_turns(TurnPlan::new(&gpus, Some(&options)));
    assert_eq!(
        (quantum(&tables, &gpus, 0), quantum(&tables, &gpus, 1)),
        (None, Some(4_000_000))
    );
    // Removed: the check makes it again and claims the line again.
    shm::unlink(&names.0.priority).expect("unlink");
    tables.check();
    assert_eq!(tables.repairs().priority, 1);
    assert_eq!(
        (quantum(&tables, &gpus, 0), quantum(&tables, &gpus, 1)),
        (None, Some(4_000_000))
    );
}

#[test]
fn an_automatic_gpu_takes_turns_while_two_capped_pods_contend_and_a_calm_second_after() {
    let names = Names::new("auto");
    let mut tables = names.tables();
    let gpus = SimulatedGpus::new(3).gpus().expect("gpus");
    let options = TurnOptions {
        gpus: vec![gpus[1].uuid.clone()],
        auto_gpus: vec![gpus[0].uuid.clone()],
        quantum_us: 6_000,
    };
    tables.set_turns(TurnPlan::new(&gpus, Some(&options)));
    let said = |tables: &NodeTables| quanta(tables, &gpus);
    // Nothing contends yet: GPU 0 has no line; GPU 1 always takes turns.
    assert_eq!(said(&tables), [None, Some(6_000_000), None]);
    let start = Instant::now();
    let at = |ms: u64| start + Duration::from_millis(ms);
    let uuid0 = gpus[0].uuid.to_lowercase();
    tables.contended(&uuid0, 1, at(0));
    assert_eq!(said(&tables)[0], None, "one capped pod");
    tables.contended(&uuid0, 2, at(10));
    assert_eq!(said(&tables)[0], Some(6_000_000), "two capped pods");
    // The other GPUs keep their plan whatever is said of them.
    tables.contended(&gpus[1].uuid, 0, at(10));
    tables.contended(&gpus[2].uuid, 5, at(10));
    tables.contended(&gpus[2].uuid, 5, at(3_000));
    assert_eq!(said(&tables), [Some(6_000_000), Some(6_000_000), None]);

    // Calm for less than a second, contended again, then calm for one.
    tables.contended(&uuid0, 1, at(100));
    tables.contended(&uuid0, 0, at(1_000));
    assert_eq!(said(&tables)[0], Some(6_000_000), "calm 0.9 s");
    tables.contended(&uuid0, 3, at(1_050));
    tables.contended(&uuid0, 1, at(1_100));
    tables.contended(&uuid0, 1, at(2_050));
    assert_eq!(said(&tables)[0], Some(6_000_000), "calm 0.95 s since 1.1 s");
    // The check keeps the line as the plan says now.
    tables.check();
    assert_eq!(said(&tables)[0], Some(6_000_000));
    assert_eq!(
        turn_modes(&tables),
        [(true, true), (true, false), (false, false)]
    );

    tables.contended(&uuid0, 1, at(2_100));
    assert_eq!(said(&tables)[0], Some(0), "calm a second");
    // A pod that gives it turns again is set back at the check.
    let priority = tables.priority.as_ref().expect("priority table");
    priority
        .turn_line(uuid_key(&gpus[0].uuid))
        .expect("line")
        .set_quantum_us(2_000);
    tables.check();
    assert_eq!(said(&tables)[0], Some(0));
    assert_eq!(turn_modes(&tables)[0], (false, true));
}
