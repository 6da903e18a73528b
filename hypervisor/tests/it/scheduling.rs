//! Weighted fair sharing as the buckets see it, and rescheduling on admission.

use crate::common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use gpushare_utils::bucket::{CAPACITY_NS, monotonic_ns};

/// Waits for the rates of `regions` on device 0 to be `want` (ppm).
fn rates_become(regions: &[&RegionView], want: &[u32]) {
    let ok = wait_for(Duration::from_secs(3), || {
        regions.iter().map(|r| r.rate(0)).collect::<Vec<_>>() == want
    });
    let got: Vec<u32> = regions.iter().map(|r| r.rate(0)).collect();
    assert!(ok, "rates {got:?}, want {want:?}");
}

#[test]
fn weights_one_to_three_get_25_and_75_percent() {
    let (a, b) = (unique("w-a"), unique("w-b"));
    let config = format!(
        "{}{}",
        pod_toml(&a, &["index = 0\nweight = 1\npolicy = \"fixed\""]),
        pod_toml(&b, &["index = 0\nweight = 3\npolicy = \"fixed\""]),
    );
    let _h = Harness::start(&config, 1, &[&a, &b]);
    let (ra, rb) = (RegionView::open(&a), RegionView::open(&b));
    // Nobody demanding: each holds its share of a full house.
    rates_become(&[&ra, &rb], &[250_000, 750_000]);
    ra.set_waiting(0, true);
    rb.set_waiting(0, true);
    rates_become(&[&ra, &rb], &[250_000, 750_000]);
    // b goes idle: a takes the whole GPU (fixed, no cap).
    rb.set_waiting(0, false);
    rates_become(&[&ra, &rb], &[1_000_000, 750_000]);
    // Launch counts moving are demand too (for 200 ms).
    rb.bucket(0).launches.fetch_add(1, Ordering::Relaxed);
    rates_become(&[&ra, &rb], &[250_000, 750_000]);
    rb.set_waiting(0, true);
    rates_become(&[&ra, &rb], &[250_000, 750_000]);
    assert_eq!(ra.limits(0).managed.load(Ordering::Acquire), 1);
    assert_eq!(ra.limits(0).ceiling_ppm.load(Ordering::Acquire), 250_000);
}

#[test]
fn the_status_reports_a_pods_launches_and_the_gpu_time_charged_for_them() {
    let a = unique("charged");
    let h = Harness::start(&pod_toml(&a, &["index = 0\ncap = 40"]), 1, &[&a]);
    let ra = RegionView::open(&a);
    let before = h.first_gpu_status(&a);
    assert_eq!((before.launches, before.charged_ns), (0, 0));
    ra.bucket(0).launches.fetch_add(3, Ordering::Relaxed);
    ra.bucket(0)
        .charged_ns
        .fetch_add(1_350_000, Ordering::Relaxed);
    let after = h.first_gpu_status(&a);
    assert_eq!((after.launches, after.charged_ns), (3, 1_350_000));
}

#[test]
fn the_pods_see_whether_the_scheduler_counts_their_demand() {
    let (a, b) = (unique("seen-a"), unique("seen-b"));
    let config = format!(
        "{}{}",
        pod_toml(&a, &["index = 0\ncap = 40"]),
        pod_toml(&b, &["index = 0\npolicy = \"elastic\""]),
    );
    let h = Harness::start(&config, 1, &[&a, &b]);
    let (ra, rb) = (RegionView::open(&a), RegionView::open(&b));
    let seen = |r: &RegionView| r.1.demand_seen(&gpu(0));
    assert!(!seen(&ra) && !seen(&rb), "idle: their waits ask");
    // A waiting thread is demand: counted at the next tick, so the pod's
    // waits stop asking for admission.
    ra.set_waiting(0, true);
    assert!(wait_for(Duration::from_secs(3), || seen(&ra)));
    assert!(!seen(&rb));
    // Launches are demand too, for the active window (200 ms).
    rb.bucket(0).launches.fetch_add(1, Ordering::Relaxed);
    assert!(wait_for(Duration::from_secs(3), || seen(&rb)));
    assert!(wait_for(Duration::from_secs(3), || !seen(&rb)));
    // Suspended, a pod is never counted: its trapped waits ask (and wait
    // in the hypervisor until it resumes).
    h.hv.hypervisor().suspend(&a).expect("suspend");
    assert!(wait_for(Duration::from_secs(3), || !seen(&ra)));
    h.hv.hypervisor().resume(&a).expect("resume");
    assert!(wait_for(Duration::from_secs(3), || seen(&ra)));
}

#[test]
fn caps_are_honoured_and_their_unused_share_redistributed() {
    let (a, b, c) = (unique("cap-a"), unique("cap-b"), unique("cap-c"));
    let config = format!(
        "{}{}{}",
        pod_toml(&a, &["index = 0\ncap = 10"]),
        pod_toml(&b, &["index = 0\npolicy = \"fixed\""]),
        pod_toml(&c, &["index = 0\nweight = 2\npolicy = \"fixed\""]),
    );
    let _h = Harness::start(&config, 1, &[&a, &b, &c]);
    let (ra, rb, rc) = (
        RegionView::open(&a),
        RegionView::open(&b),
        RegionView::open(&c),
    );
    for r in [&ra, &rb, &rc] {
        r.set_waiting(0, true);
    }
    // a is held at 10%; its unused 23.3% goes to b and c by weight 1:2.
    rates_become(&[&ra, &rb, &rc], &[100_000, 300_000, 600_000]);
    // With c idle, b gets everything a leaves.
    rc.set_waiting(0, false);
    rates_become(&[&ra, &rb], &[100_000, 900_000]);
}

#[test]
fn elastic_takes_idle_time_fixed_stays_at_its_cap() {
    let (f, e, o) = (unique("el-f"), unique("el-e"), unique("el-o"));
    let config = format!(
        "{}{}{}",
        pod_toml(&f, &["index = 0\ncap = 30"]),
        pod_toml(&e, &["index = 0\nshare = 30\npolicy = \"elastic\""]),
        pod_toml(&o, &["index = 0\npolicy = \"fixed\"\nweight = 2"]),
    );
    let _h = Harness::start(&config, 1, &[&f, &e, &o]);
    let (rf, re, ro) = (
        RegionView::open(&f),
        RegionView::open(&e),
        RegionView::open(&o),
    );
    // Alone, the fixed pod stays at its cap.
    rf.set_waiting(0, true);
    assert!(wait_for(Duration::from_secs(3), || rf.rate(0) == 300_000));
    rf.set_waiting(0, false);
    std::thread::sleep(Duration::from_millis(300));
    // Alone, the elastic pod takes the whole GPU...
    re.set_waiting(0, true);
    assert!(wait_for(Duration::from_secs(3), || re.rate(0) == 1_000_000));
    assert_eq!(re.limits(0).ceiling_ppm.load(Ordering::Acquire), 1_000_000);
    // ...and gives it back when another pod wants it, keeping its share:
    // weight 1 against 2 would be 33.3%, its 30% floor is below that.
    ro.set_waiting(0, true);
    rates_become(&[&re, &ro], &[333_333, 666_666]);
    // The fixed pod joins: f and o split by weight 1:2 what e's 30% floor
    // leaves (f's 30% cap is not reached).
    rf.set_waiting(0, true);
    rates_become(&[&rf, &re, &ro], &[233_333, 300_000, 466_666]);
}

/// Pods a (weight 1) and b (weight 3, waiting) on GPU 0, at the rates of
/// b alone wanting it; a's worker registered, asking for admission.
struct Debtor {
    h: Harness,
    a: String,
    ra: RegionView,
    rb: RegionView,
    client: RawClient,
    body: String,
}

impl Debtor {
    fn start(tag: &str) -> Self {
        let (a, b) = (unique(&format!("{tag}-a")), unique(&format!("{tag}-b")));
        let config = format!(
            "{}{}",
            pod_toml(&a, &["index = 0\npolicy = \"fixed\""]),
            pod_toml(&b, &["index = 0\npolicy = \"fixed\"\nweight = 3"]),
        );
        let h = Harness::start(&config, 1, &[&a, &b]);
        let (ra, rb) = (RegionView::open(&a), RegionView::open(&b));
        rb.set_waiting(0, true);
        rates_become(&[&ra, &rb], &[250_000, 1_000_000]);
        let worker = register_ok(&h.url(), &a).worker_id;
        let body = format!(
            "{{\"worker_id\":\"{worker}\",\"uuid\":\"{}\",\"cost_ns\":50000}}",
            gpu(0)
        );
        let client = RawClient::new(h.addr());
        Self {
            h,
            a,
            ra,
            rb,
            client,
            body,
        }
    }

    /// a traps with `debt_ns` of debt: (status, reply, how long it took).
    fn ask(&mut self, debt_ns: i64) -> (u16, String, Duration) {
        let bucket = self.ra.bucket(0);
        // The refill time first: a refill between the two stores (the daemon
        // reads the bucket too) then earns nothing, where it could otherwise
        // bank the time since the last one over the debt, and the answer
        // would come before the debt could have been paid back.
        bucket
            .refilled_at_ns
            .store(monotonic_ns(), Ordering::Release);
        bucket.tokens_ns.store(-debt_ns, Ordering::Release);
        let start = Instant::now();
        let (status, reply) =
            self.client
                .request("POST", "/api/v1/admission", &token_of(&self.a), &self.body);
        (status, reply, start.elapsed())
    }
}

#[test]
fn an_admission_request_reschedules_at_once() {
    let mut d = Debtor::start("adm");
    // a traps with an empty bucket: the answer comes once a's share has
    // refilled it, and b's rate was cut in the same request.
    let (status, reply, took) = d.ask(100_000);
    assert_eq!(status, 200, "{reply}");
    // Read right after the answer: a's demand from the request keeps it
    // active for the scheduler's ACTIVE_WINDOW (200 ms), after which a
    // background tick may give b the whole GPU again. Microseconds of work
    // here against 200 ms of window.
    assert_eq!(
        d.rb.rate(0),
        750_000,
        "b not cut back by the admission's tick"
    );
    let granted: u64 =
        serde_json::from_str::<serde_json::Value>(&reply).expect("json")["granted_ns"]
            .as_u64()
            .expect("granted_ns");
    // A request whose budget does not come within the hold (ADMISSION_WAIT,
    // 1 ms, from the daemon's first look) is answered granted_ns 0: this
    // catches a daemon that did not wait for the 400 µs refill.
    assert!(granted > 0 && granted <= CAPACITY_NS as u64, "{reply}");
    // 100 µs of debt at 25% takes 400 µs to pay back: an answer sooner gave
    // budget the pod had not earned. A lower bound, which load cannot break.
    // How soon after that the answer comes is a performance figure, measured
    // by benches/admission_latency.rs, not asserted here.
    assert!(took >= Duration::from_micros(300), "{took:?}");
    println!("admission with 100 µs of debt at 25%: {took:?}");
}

/// A pod in debt it cannot pay back within the hold (10 ms of debt at 25%
/// takes 40 ms) is answered at once with no budget, not held to say the
/// same; its rate counts it in all the same, and it waits on its bucket.
#[test]
fn an_admission_in_debt_beyond_the_hold_is_answered_at_once() {
    let mut d = Debtor::start("debt");
    // The quickest of ten within the admission latency target, 2 ms: answers
    // delayed by a loaded machine do not decide it, and a daemon that held
    // the request for the pod's refill would answer every one after 40 ms.
    let mut quickest = Duration::MAX;
    for _ in 0..10 {
        let (status, reply, took) = d.ask(10_000_000);
        quickest = quickest.min(took);
        assert_eq!((status, reply.as_str()), (200, "{\"granted_ns\":0}"));
        assert_eq!(d.rb.rate(0), 750_000, "b not cut back by the admission");
    }
    assert!(quickest < Duration::from_millis(2), "{quickest:?}");
    let admission = d.h.hv.hypervisor().status().admission;
    assert_eq!((admission.count, admission.timeouts), (10, 10));
    println!("admission with 10 ms of debt at 25%: answered in {quickest:?}");
}

/// Co-run GPU 0's elastic pods, weights 1 and 2, use all they are given:
/// while the GPU reads 80% busy they split more than its time, up to the
/// most; once it reads full, 100% again, by weight. The
/// same pods on time-sliced GPU 1 keep 100%, and so do pods that leave
/// budget unused.
#[test]
fn a_corun_gpu_that_idles_while_its_elastic_pods_use_all_they_get_gives_them_more() {
    use hypervisor_core::scheduler::capacity::MAX_CAPACITY_PPM;
    let pods: Vec<String> = ["cap-a", "cap-b", "cap-c", "cap-d"]
        .into_iter()
        .map(unique)
        .collect();
    let elastic = |index: u32, weight: u32| {
        format!("index = {index}\nweight = {weight}\npolicy = \"elastic\"")
    };
    let config = format!(
        "{}{}{}{}",
        pod_toml(&pods[0], &[&elastic(0, 1)]),
        pod_toml(&pods[1], &[&elastic(0, 2)]),
        pod_toml(&pods[2], &[&elastic(1, 1)]),
        pod_toml(&pods[3], &[&elastic(1, 2)]),
    );
    let names: Vec<&str> = pods.iter().map(String::as_str).collect();
    let h = Harness::start(&config, 2, &names);
    let mps = h.config.dir.join("mps");
    h.hv.hypervisor()
        .set_corun_gpus(&hypervisor_corun::CorunOptions {
            gpus: vec![gpu(0)],
            dir: mps.clone(),
            host_dir: mps,
            latency_reserve: 20,
            control: "nvidia-cuda-mps-control".into(),
            private_shm: false,
        });
    let views: Vec<(RegionView, usize)> = pods
        .iter()
        .zip([0, 0, 1, 1])
        .map(|(pod, dev)| (RegionView::open(pod), dev))
        .collect();
    for (view, dev) in &views {
        view.set_waiting(*dev, true);
    }
    h.sim.set_busy(0, Some(80));
    h.sim.set_busy(1, Some(80));
    let capacity = |pod: &str| {
        let status = h.hv.hypervisor().status();
        let pod = status.pods.into_iter().find(|p| p.id == pod);
        pod.and_then(|p| p.gpus.into_iter().next())
            .map(|g| g.elastic_capacity_ppm)
    };
    let rates = || -> Vec<u32> { views.iter().map(|(v, dev)| v.rate(*dev)).collect() };
    let charging = std::sync::atomic::AtomicBool::new(true);
    /// Stops the charging when the test ends, passed or not.
    struct Stop<'a>(&'a std::sync::atomic::AtomicBool);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            self.0.store(false, Ordering::Relaxed);
        }
    }
    std::thread::scope(|scope| {
        let _stop = Stop(&charging);
        // Each pod charged what its rate gives it, as a pod that uses it all.
        scope.spawn(|| {
            let mut last = Instant::now();
            while charging.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(5));
                let now = Instant::now();
                let span = now.duration_since(last).as_nanos() as u64;
                last = now;
                for (view, dev) in &views {
                    let ns = span * u64::from(view.rate(*dev)) / 1_000_000;
                    view.bucket(*dev)
                        .charged_ns
                        .fetch_add(ns, Ordering::Relaxed);
                }
            }
        });
        let most = wait_for(Duration::from_secs(10), || {
            capacity(&pods[0]) == Some(MAX_CAPACITY_PPM)
        });
        assert!(
            most,
            "capacity {:?}, rates {:?}",
            capacity(&pods[0]),
            rates()
        );
        // More than the GPU's time; each pod at most the whole of it (the
        // split by weight below that is fairshare's to test).
        const { assert!(MAX_CAPACITY_PPM >= 3_000_000) };
        assert!(wait_for(Duration::from_secs(3), || rates()[..2]
            == [1_000_000, 1_000_000]));
        assert_eq!(capacity(&pods[2]), Some(1_000_000));
        assert_eq!(rates()[2..], [333_333, 666_666]);
        // Full: back to the GPU's time, the weights deciding.
        h.sim.set_busy(0, Some(100));
        assert!(wait_for(Duration::from_secs(10), || {
            capacity(&pods[0]) == Some(1_000_000)
        }));
        assert!(wait_for(Duration::from_secs(3), || rates()[..2]
            == [333_333, 666_666]));
    });
    // Idle again, but the pods use nothing: nothing is handed out.
    h.sim.set_busy(0, Some(80));
    std::thread::sleep(Duration::from_millis(1_000));
    assert_eq!(capacity(&pods[0]), Some(1_000_000));
    assert_eq!(rates(), [333_333, 666_666, 333_333, 666_666]);
}
