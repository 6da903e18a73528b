use super::*;

const GIB: u64 = 1 << 30;
const POLICY: RoomPolicy = RoomPolicy {
    idle_after_ms: 1_000,
    latency: LatencyPods::Last,
    ranking: Ranking::Lru,
    min_resident_ms: 0,
};
const LRU2: RoomPolicy = RoomPolicy {
    ranking: Ranking::Lru2,
    min_resident_ms: 3_000,
    ..POLICY
};

fn pod(name: &str, gib: u64, last_call_ms: u64, latency: bool) -> Candidate {
    Candidate {
        pod: name.into(),
        bytes: gib * GIB,
        last_call_ms,
        previous_use_ms: 0,
        back_ms: 0,
        latency,
        stays: false,
        ready: false,
        preparing: false,
    }
}

/// A batch pod of `gib` whose last two uses ended at `previous` and
/// `last`.
fn used(name: &str, gib: u64, previous: u64, last: u64) -> Candidate {
    Candidate {
        previous_use_ms: previous,
        ..pod(name, gib, last, false)
    }
}

/// The serving policy's timings: idle 200 ms after a call, a pod
/// brought back kept 250 ms.
const SERVING: RoomPolicy = RoomPolicy {
    idle_after_ms: 200,
    min_resident_ms: 250,
    ..LRU2
};

/// `candidate`, its host copies ready.
fn ready(candidate: Candidate) -> Candidate {
    Candidate {
        ready: true,
        ..candidate
    }
}

fn names(chosen: &[&Candidate]) -> Vec<String> {
    chosen.iter().map(|c| c.pod.clone()).collect()
}

#[test]
fn host_copies_are_prepared_for_the_idle_pod_that_goes_next_within_host_room() {
    let pods = [
        pod("recent", 8, 8_000, false),
        pod("oldest", 8, 1_000, false),
        pod("big", 30, 2_000, false),
        pod("busy", 8, 9_900, false),
    ];
    let all = |_: &Candidate| true;
    let prepare = |room, unprepared: &dyn Fn(&Candidate) -> bool| {
        prepare_next(&pods, unprepared, room, 10_000, POLICY).map(|c| c.pod.clone())
    };
    assert_eq!(prepare(u64::MAX, &all).as_deref(), Some("oldest"));
    // The next one once it keeps its copies; past what host room takes.
    let not_oldest = |c: &Candidate| c.pod != "oldest";
    assert_eq!(prepare(u64::MAX, &not_oldest).as_deref(), Some("big"));
    assert_eq!(prepare(8 * GIB, &not_oldest).as_deref(), Some("recent"));
    assert_eq!(prepare(4 * GIB, &all), None);
    // A busy pod is never prepared: it is not about to go.
    let only_busy = |c: &Candidate| c.pod == "busy";
    assert_eq!(prepare(u64::MAX, &only_busy), None);
}

#[test]
fn kept_copies_are_given_back_by_the_most_recently_called_first() {
    let mut kept = vec![
        ("next".to_owned(), 1_000),
        ("busy".to_owned(), 9_000),
        ("later".to_owned(), 5_000),
    ];
    give_back_order(&mut kept);
    let order: Vec<&str> = kept.iter().map(|(pod, _)| pod.as_str()).collect();
    assert_eq!(order, ["busy", "later", "next"]);
}

#[test]
fn the_least_recently_used_idle_pods_go_first_and_no_more_than_needed() {
    let pods = [
        pod("recent", 8, 8_000, false),
        pod("oldest", 8, 1_000, false),
        pod("older", 8, 2_000, false),
        pod("busy", 30, 9_900, false),
    ];
    assert_eq!(
        names(&victims(&pods, 4 * GIB, u64::MAX, 10_000, POLICY)),
        ["oldest"]
    );
    assert_eq!(
        names(&victims(&pods, 12 * GIB, u64::MAX, 10_000, POLICY)),
        ["oldest", "older"]
    );
    // The busy pod is not idle: 24 GiB of idle pods cannot free 30.
    assert!(victims(&pods, 30 * GIB, u64::MAX, 10_000, POLICY).is_empty());
}

#[test]
fn room_is_had_now_from_idle_pods_and_ever_from_every_pod_that_may_go() {
    let staying = Candidate {
        stays: true,
        ..pod("stays", 40, 1_000, false)
    };
    let pods = [
        pod("idle", 8, 1_000, false),
        pod("busy", 8, 9_900, false),
        pod("latency", 8, 1_000, true),
        staying,
    ];
    let never = RoomPolicy {
        latency: LatencyPods::Never,
        ..POLICY
    };
    // Free already, or freed by the idle pods (the latency pod last).
    assert!(room_now(&pods, 4 * GIB, 4 * GIB, 0, 10_000, POLICY));
    assert!(room_now(&pods, 12 * GIB, 4 * GIB, u64::MAX, 10_000, POLICY));
    assert!(room_now(&pods, 20 * GIB, 4 * GIB, u64::MAX, 10_000, POLICY));
    assert!(!room_now(&pods, 20 * GIB, 4 * GIB, u64::MAX, 10_000, never));
    // The busy pod is not idle now, but may go once it is.
    assert!(!room_now(
        &pods,
        21 * GIB,
        4 * GIB,
        u64::MAX,
        10_000,
        POLICY
    ));
    assert!(room_ever(&pods, 28 * GIB, 4 * GIB, u64::MAX, POLICY));
    // Never past what every pod that may go frees, nor host memory.
    assert!(!room_ever(&pods, 29 * GIB, 4 * GIB, u64::MAX, POLICY));
    assert!(!room_ever(&pods, 21 * GIB, 4 * GIB, u64::MAX, never));
    assert!(!room_ever(&pods, 21 * GIB, 4 * GIB, 16 * GIB, POLICY));
}

#[test]
fn latency_pods_come_last_or_never() {
    let pods = [
        pod("latency", 8, 1_000, true),
        pod("batch", 8, 5_000, false),
    ];
    assert_eq!(
        names(&victims(&pods, GIB, u64::MAX, 10_000, POLICY)),
        ["batch"]
    );
    assert_eq!(
        names(&victims(&pods, 16 * GIB, u64::MAX, 10_000, POLICY)),
        ["batch", "latency"]
    );
    let never = RoomPolicy {
        latency: LatencyPods::Never,
        ..POLICY
    };
    assert!(victims(&pods, 16 * GIB, u64::MAX, 10_000, never).is_empty());
}

#[test]
fn a_stamp_in_the_future_reads_as_the_oldest_and_idle() {
    let pods = [pod("old", 8, 1_000, false), pod("forged", 8, 99_000, false)];
    assert_eq!(
        names(&victims(&pods, GIB, u64::MAX, 10_000, POLICY)),
        ["forged"]
    );
    assert_eq!(stamp_age(99_000, 10_000), u64::MAX);
    assert_eq!(stamp_age(9_000, 10_000), 1_000);
}

#[test]
fn the_host_cap_skips_pods_that_would_not_fit_there() {
    let pods = [pod("big", 40, 1_000, false), pod("small", 4, 2_000, false)];
    assert_eq!(
        names(&victims(&pods, 2 * GIB, 8 * GIB, 10_000, POLICY)),
        ["small"]
    );
    assert!(victims(&pods, 10 * GIB, 8 * GIB, 10_000, POLICY).is_empty());
}

#[test]
fn lru_2_keeps_a_pod_used_often_over_one_used_once_more_recently() {
    let pods = [
        used("popular", 8, 4_000, 6_000),
        used("once", 8, 0, 7_000),
        used("twice-long-ago", 8, 1_000, 8_000),
    ];
    assert_eq!(
        names(&ranked(&pods, 10_000, LRU2, RoomFor::Call)),
        ["once", "twice-long-ago", "popular"]
    );
    // By recency alone the popular pod, last called first, goes first.
    assert_eq!(
        names(&ranked(&pods, 10_000, POLICY, RoomFor::Call)),
        ["popular", "once", "twice-long-ago"]
    );
}

#[test]
fn where_the_uses_tie_the_larger_pod_goes_first() {
    let pods = [used("small", 4, 0, 5_000), used("large", 12, 0, 5_000)];
    assert_eq!(
        names(&ranked(&pods, 10_000, LRU2, RoomFor::Call)),
        ["large", "small"]
    );
    assert_eq!(
        names(&victims(&pods, GIB, u64::MAX, 10_000, LRU2)),
        ["large"]
    );
}

#[test]
fn a_pod_whose_host_copies_are_ready_goes_before_one_that_would_pin_first() {
    let pods = [
        used("oldest", 8, 1_000, 2_000),
        ready(used("copied", 8, 5_000, 6_000)),
        used("older", 8, 3_000, 4_000),
    ];
    assert_eq!(
        names(&ranked(&pods, 10_000, LRU2, RoomFor::Call)),
        ["copied", "oldest", "older"]
    );
    assert_eq!(
        names(&victims(&pods, GIB, u64::MAX, 10_000, LRU2)),
        ["copied"]
    );
    // Still after every pod not just brought back, and latency pods last.
    let back = ready(Candidate {
        back_ms: 9_000,
        ..used("back", 8, 0, 9_000)
    });
    let latency = ready(pod("latency", 8, 1_000, true));
    let pods = [back, latency, used("cold", 8, 0, 3_000)];
    assert_eq!(
        names(&ranked(&pods, 10_000, LRU2, RoomFor::Call)),
        ["cold", "latency", "back"]
    );
}

#[test]
fn ahead_of_need_a_popular_pod_keeping_its_copies_stays_and_the_coldest_goes() {
    let policy = SERVING;
    // Brought back a second ago keeping its copies, used twice since the
    // cold pod's last call.
    let popular = ready(Candidate {
        back_ms: 9_000,
        ..used("popular", 8, 8_000, 9_500)
    });
    let cold = used("cold", 8, 0, 2_000);
    let mild = used("mild", 8, 1_000, 5_000);
    let pods = [popular.clone(), cold.clone(), mild.clone()];
    let first =
        |pods: &[Candidate], policy| ahead(pods, u64::MAX, 10_000, policy).map(|c| c.pod.clone());
    assert_eq!(first(&pods, policy).as_deref(), Some("cold"));
    assert_eq!(
        names(&ranked(&pods, 10_000, policy, RoomFor::Headroom)),
        ["cold", "mild", "popular"]
    );
    let unprepared = |c: &Candidate| !c.ready;
    let next = prepare_next(&pods, unprepared, u64::MAX, 10_000, policy);
    assert_eq!(next.map(|c| c.pod.as_str()), Some("cold"));
    // A call that waits takes the pod that goes fastest, popular or not.
    assert_eq!(
        names(&victims(&pods, GIB, u64::MAX, 10_000, policy)),
        ["popular"]
    );
    // Used once since that call: it goes first, as does one whose use
    // before the last is in the future (forged: the oldest there is).
    let once = |previous| {
        ready(Candidate {
            back_ms: 9_000,
            ..used("once", 8, previous, 9_500)
        })
    };
    for previous in [1_500, 20_000] {
        let pods = [once(previous), cold.clone(), mild.clone()];
        assert_eq!(first(&pods, policy).as_deref(), Some("once"), "{previous}");
    }
    // LRU counts no uses; and with no idle pod lacking copies, the
    // copies put it first.
    let lru = RoomPolicy {
        ranking: Ranking::Lru,
        ..policy
    };
    assert_eq!(first(&pods, lru).as_deref(), Some("popular"));
    let busy = [
        popular.clone(),
        ready(used("other", 8, 1_000, 3_000)),
        used("busy", 8, 1_000, 9_990),
    ];
    assert_eq!(
        names(&ranked(&busy, 10_000, policy, RoomFor::Headroom)),
        ["other", "popular"]
    );
    // Nor is a popular pod about to be allowed to go waited for ahead of
    // need; a call waiting for room still waits for it.
    let just_back = ready(Candidate {
        back_ms: 9_900,
        ..used("popular", 8, 8_000, 9_950)
    });
    let pods = [just_back, cold, mild];
    let soon = |room_for| ready_soon(&pods, GIB, u64::MAX, 10_000, policy, room_for);
    assert_eq!(soon(RoomFor::Headroom), None);
    assert_eq!(soon(RoomFor::Call), Some(150));
}

#[test]
fn a_ready_pod_about_to_be_allowed_to_go_is_worth_waiting_for() {
    let policy = SERVING;
    // Brought back 100 ms ago, its last call 50 ms ago: it may go in
    // 150 ms (idle then, and past its 250 ms).
    let back = ready(Candidate {
        back_ms: 9_900,
        ..used("back", 8, 0, 9_950)
    });
    let cold = used("cold", 8, 1_000, 2_000);
    let pods = [back.clone(), cold.clone()];
    let first = ahead(&pods, u64::MAX, 10_000, policy).map(|c| c.pod.as_str());
    assert_eq!(first, Some("cold"));
    assert_eq!(
        ready_soon(
            &[back.clone(), cold.clone()],
            GIB,
            u64::MAX,
            10_000,
            policy,
            RoomFor::Call
        ),
        Some(150)
    );
    // Once it may go, it goes first and no wait is needed.
    let pods = [back.clone(), cold.clone()];
    let first = ahead(&pods, u64::MAX, 10_150, policy).map(|c| c.pod.as_str());
    assert_eq!(first, Some("back"));
    assert_eq!(
        ready_soon(
            &[back.clone(), cold.clone()],
            GIB,
            u64::MAX,
            10_150,
            policy,
            RoomFor::Call
        ),
        None
    );
    // Not worth it: no copies, copies the host could not take, a pod
    // that stays, one busy far longer than the wait is worth.
    let no_copies = Candidate {
        ready: false,
        ..back.clone()
    };
    assert_eq!(
        ready_soon(
            &[no_copies, cold.clone()],
            GIB,
            u64::MAX,
            10_000,
            policy,
            RoomFor::Call
        ),
        None
    );
    assert_eq!(
        ready_soon(
            std::slice::from_ref(&back),
            GIB,
            4 * GIB,
            10_000,
            policy,
            RoomFor::Call
        ),
        None
    );
    // Nor a pod that frees less than is needed.
    assert_eq!(
        ready_soon(
            std::slice::from_ref(&back),
            9 * GIB,
            u64::MAX,
            10_000,
            policy,
            RoomFor::Call
        ),
        None
    );
    let stays = Candidate {
        stays: true,
        ..back.clone()
    };
    assert_eq!(
        ready_soon(&[stays], GIB, u64::MAX, 10_000, policy, RoomFor::Call),
        None
    );
    let long = RoomPolicy {
        min_resident_ms: 5_000,
        ..policy
    };
    assert_eq!(
        ready_soon(
            std::slice::from_ref(&back),
            GIB,
            u64::MAX,
            10_000,
            long,
            RoomFor::Call
        ),
        None
    );
    // The soonest of several.
    let sooner = ready(Candidate {
        back_ms: 9_800,
        ..used("sooner", 8, 0, 9_850)
    });
    assert_eq!(
        ready_soon(
            &[back, sooner, cold],
            GIB,
            u64::MAX,
            10_000,
            policy,
            RoomFor::Call
        ),
        Some(50)
    );
}

#[test]
fn room_waits_a_moment_for_a_ready_pod_rather_than_pin_or_wait_for_a_preparation() {
    let policy = SERVING;
    let back = ready(Candidate {
        back_ms: 9_900,
        ..used("back", 8, 0, 9_950)
    });
    let cold = used("cold", 8, 1_000, 2_000);
    let pods = [back.clone(), cold.clone()];
    let step = |pods, may_wait| room_step(pods, GIB, u64::MAX, 10_000, policy, may_wait);
    // The cold pod would pin: the pod just back may go in 150 ms.
    assert_eq!(step(&pods, true), Some(RoomStep::Wait(150)));
    assert_eq!(step(&pods, false), Some(RoomStep::Go(&pods[1])));
    // A cold pod whose copies are being made goes first, but its
    // swap-out would wait for the rest of that: the ready pod is
    // waited for too.
    let preparing = [
        back.clone(),
        Candidate {
            preparing: true,
            ..cold.clone()
        },
    ];
    assert_eq!(step(&preparing, true), Some(RoomStep::Wait(150)));
    // A pod whose copies are ready goes before one whose copies are still
    // being made, colder or not.
    let warm = ready(used("warm", 8, 8_000, 9_000));
    let making = Candidate {
        pod: "making".into(),
        ..preparing[1].clone()
    };
    let both = [making, warm, cold.clone()];
    assert_eq!(step(&both, true), Some(RoomStep::Go(&both[1])));
    assert_eq!(
        names(&ranked(&both, 10_000, policy, RoomFor::Call)),
        ["warm", "making", "cold"]
    );
    // A cold pod that keeps its copies goes at once.
    let kept = [back, ready(cold)];
    assert_eq!(step(&kept, true), Some(RoomStep::Go(&kept[1])));
    assert_eq!(step(&[], true), None);
}

#[test]
fn a_pod_just_brought_back_goes_only_when_nothing_else_can() {
    let back = Candidate {
        back_ms: 8_000,
        ..used("back", 8, 0, 8_500)
    };
    let pods = [back, used("other", 8, 7_000, 9_000)];
    assert_eq!(
        names(&victims(&pods, GIB, u64::MAX, 10_000, LRU2)),
        ["other"]
    );
    // Nothing else can free 16 GiB: the pod just back goes too.
    assert_eq!(
        names(&victims(&pods, 16 * GIB, u64::MAX, 10_000, LRU2)),
        ["other", "back"]
    );
    // Ahead of need it never goes while it is that recent.
    assert_eq!(
        ahead(&pods[..1], u64::MAX, 10_000, LRU2).map(|c| c.pod.as_str()),
        None
    );
    assert_eq!(
        ahead(&pods[..1], u64::MAX, 11_001, LRU2).map(|c| c.pod.as_str()),
        Some("back")
    );
}

#[test]
fn a_pod_that_must_stay_is_never_chosen() {
    let stays = Candidate {
        stays: true,
        ..used("stays", 8, 0, 1_000)
    };
    let pods = [stays, used("other", 4, 0, 2_000)];
    assert_eq!(
        names(&ranked(&pods, 10_000, LRU2, RoomFor::Call)),
        ["other"]
    );
    assert!(victims(&pods, 8 * GIB, u64::MAX, 10_000, LRU2).is_empty());
    assert_eq!(
        ahead(&pods[..1], u64::MAX, 10_000, LRU2).map(|c| c.pod.as_str()),
        None
    );
}

#[test]
fn ahead_of_need_takes_the_first_pod_host_memory_can_take() {
    let pods = [used("big", 40, 0, 1_000), used("small", 4, 0, 2_000)];
    assert_eq!(
        ahead(&pods, 8 * GIB, 10_000, LRU2).map(|c| c.pod.as_str()),
        Some("small")
    );
    assert_eq!(
        ahead(&pods, u64::MAX, 10_000, LRU2).map(|c| c.pod.as_str()),
        Some("big")
    );
    assert!(ahead(&pods, GIB, 10_000, LRU2).is_none());
}

#[test]
fn rankings_parse_as_the_config_writes_them() {
    for ranking in [Ranking::Lru, Ranking::Lru2] {
        assert_eq!(Ranking::parse(ranking.as_str()), Some(ranking));
    }
    assert_eq!(Ranking::parse("lfu"), None);
}
