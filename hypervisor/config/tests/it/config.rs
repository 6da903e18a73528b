//! Parsing the config file and the admin limits body
//! (`hypervisor_config`).

use std::path::Path;
use std::time::Duration;

use gpushare_utils::pod::PodClass;
use hypervisor_config::*;
use hypervisor_core::spec::Policy;

fn parse_str(text: &str) -> Result<Config, ConfigError> {
    parse(text, Path::new("test.toml"), Path::new("/nonexistent"))
}

#[test]
fn a_full_file() {
    let config = parse_str(
        r#"
        listen = "127.0.0.1:9000"
        admin_token = "adm"
        worker_ttl_ms = 5000
        health_interval_ms = 0
        region_mode = "0640"
        [[pods]]
        id = "a"
        token = "ta"
        [[pods.gpus]]
        index = 0
        memory = "4g"
        cap = 30
        [[pods.gpus]]
        uuid = "GPU-1234"
        memory = 1024
        weight = 3
        share = 25
        class = "latency"
        [[pods]]
        id = "b"
        token = "tb"
        "#,
    )
    .unwrap();
    assert_eq!(config.listen, "127.0.0.1:9000".parse().unwrap());
    assert!(config.admin_token.unwrap().matches("adm"));
    assert_eq!(config.settings.worker_ttl, Duration::from_secs(5));
    assert_eq!(config.settings.health_interval, None);
    assert_eq!(config.regions.mode, Some(0o640));
    let a = &config.pods[0];
    assert_eq!(a.gpus[0].memory_bytes, 4 << 30);
    assert_eq!(a.gpus[0].policy, Policy::Fixed);
    assert_eq!(a.gpus[1].policy, Policy::Elastic);
    assert_eq!(a.gpus[1].weight, 3);
    assert_eq!(a.gpus[0].class, PodClass::Batch);
    assert_eq!(a.gpus[1].class, PodClass::Latency);
    assert!(config.pods[1].gpus.is_empty());
}

#[test]
fn oversubscription_per_gpu() {
    let gpu = |line: &str| {
        let text =
            format!("[[pods]]\nid = \"a\"\ntoken = \"x\"\n[[pods.gpus]]\nindex = 0\n{line}\n");
        parse_str(&text).map(|config| config.pods[0].gpus[0].spill_bytes)
    };
    assert_eq!(gpu("").unwrap(), 0);
    assert_eq!(gpu("spill_limit = \"16g\"").unwrap(), 16 << 30);
    assert_eq!(
        gpu("spill_limit = 1024\noversubscribe = true").unwrap(),
        1024
    );
    assert_eq!(
        gpu("spill_limit = \"16g\"\noversubscribe = false").unwrap(),
        0
    );
    assert_eq!(gpu("oversubscribe = false").unwrap(), 0);
    assert_eq!(
        gpu("oversubscribe = true").unwrap(),
        gpushare_utils::limits::default_spill_limit()
    );
    let error = gpu("spill_limit = \"lots\"").unwrap_err().to_string();
    assert!(error.contains("gpu #1"), "{error}");
}

#[test]
fn errors_name_the_field() {
    let cases = [
        (
            "[[pods]]\nid = \"a\"\ntoken = \"x\"\n[[pods.gpus]]\nindex = 0\nclass = \"urgent\"\n",
            "class \"urgent\" is not latency or batch",
        ),
        ("[[pods]]\nid = \"a\"\n", "exactly one of token"),
        (
            "[[pods]]\nid = \"a\"\ntoken = \"x\"\ntoken_env = \"Y\"\n",
            "exactly one",
        ),
        ("[[pods]]\nid = \"a b\"\ntoken = \"x\"\n", "not a pod id"),
        (
            "[[pods]]\nid = \"a\"\ntoken = \"x\"\n[[pods.gpus]]\ncap = 30\n",
            "uuid and index",
        ),
        (
            "[[pods]]\nid = \"a\"\ntoken = \"x\"\n[[pods.gpus]]\nindex = 0\ncap = 0\n",
            "cap",
        ),
        (
            "[[pods]]\nid = \"a\"\ntoken = \"x\"\n[[pods.gpus]]\nindex = 0\nmemory = \"4x\"\n",
            "memory",
        ),
        (
            "[[pods]]\nid = \"a\"\ntoken = \"x\"\n[[pods.gpus]]\nindex = 0\npolicy = \"max\"\n",
            "policy",
        ),
        (
            "[[pods]]\nid = \"a\"\ntoken = \"x\"\n[[pods]]\nid = \"a\"\ntoken = \"y\"\n",
            "twice",
        ),
        ("listen = \"nowhere\"\n", "listen"),
        ("region_mode = \"0666\"\n", "o+w"),
        ("region_mode = \"0660\"\n", "g+w"),
        ("colour = 1\n", "unknown field"),
        (
            "[[pods]]\nid = \"a\"\ntoken_env = \"HV_TEST_SURELY_UNSET\"\n",
            "not set",
        ),
    ];
    for (text, want) in cases {
        let err = parse_str(text).unwrap_err().to_string();
        assert!(err.contains(want), "{text:?}: {err}");
        assert!(!err.contains('\n'), "one line: {err}");
    }
}

#[test]
fn token_files_are_relative_to_the_config() {
    let dir = std::env::temp_dir().join(format!("hv-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tok"), "from-file\n").unwrap();
    let config = parse(
        "[[pods]]\nid = \"a\"\ntoken_file = \"tok\"\n",
        &dir.join("c.toml"),
        &dir,
    )
    .unwrap();
    assert!(config.pods[0].token.matches("from-file"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A folder of the test's own, removed when dropped.
struct Dir(std::path::PathBuf);

impl Dir {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("hv-config-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn fifo(&self, name: &str) -> std::path::PathBuf {
        let path = self.0.join(name);
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid path string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        path
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn token_files_that_are_not_small_regular_files_are_refused_at_once() {
    let dir = Dir::new("tokens");
    let fifo = dir.fifo("fifo");
    std::fs::write(dir.0.join("large"), "x".repeat(4097)).unwrap();
    let cases = [
        (fifo.display().to_string(), "a FIFO, not a regular file"),
        (
            "/dev/zero".to_owned(),
            "a character device, not a regular file",
        ),
        ("large".to_owned(), "more than 4096 bytes"),
        (".".to_owned(), "a folder, not a regular file"),
    ];
    for (file, why) in cases {
        let text = format!("[[pods]]\nid = \"a\"\ntoken_file = \"{file}\"\n");
        let started = std::time::Instant::now();
        let error = parse(&text, &dir.0.join("c.toml"), &dir.0)
            .unwrap_err()
            .to_string();
        assert!(started.elapsed() < Duration::from_secs(1), "{error}");
        assert!(
            error.starts_with("pod \"a\": cannot read token file ") && error.ends_with(why),
            "{file}: {error}"
        );
        let admin = format!("admin_token_file = \"{file}\"\n");
        let error = parse(&admin, &dir.0.join("c.toml"), &dir.0)
            .unwrap_err()
            .to_string();
        assert!(error.ends_with(why), "{file}: {error}");
    }
}

#[test]
fn a_config_file_that_is_a_fifo_is_refused_at_once() {
    let dir = Dir::new("fifo");
    let fifo = dir.fifo("c.toml");
    let error = load(&fifo).unwrap_err().to_string();
    assert_eq!(
        error,
        format!("cannot read {}: a FIFO, not a regular file", fifo.display())
    );
    let large = dir.0.join("large.toml");
    std::fs::write(&large, "#".repeat(CONFIG_MAX_BYTES as usize + 1)).unwrap();
    let error = load(&large).unwrap_err().to_string();
    assert!(error.ends_with("more than 1048576 bytes"), "{error}");
}

#[test]
fn errors_show_at_most_200_characters_of_a_value() {
    let long = "x".repeat(131_000);
    let cases = [
        format!("listen = \"{long}\"\n"),
        format!("region_mode = \"{long}\"\n"),
        format!("{long} = 1\n"),
        format!("check_pids = \"{long}\"\n"),
        format!("[[pods]]\nid = \"{long}\"\ntoken = \"x\"\n"),
        format!("[[pods]]\nid = \"{long}\"\n"),
        format!("[[pods]]\nid = \"a\"\ntoken_file = \"{long}\"\n"),
        format!("[[pods]]\nid = \"a\"\ntoken_env = \"{long}\"\n"),
        format!("[[pods]]\nid = \"a\"\ntoken = \"x\"\n[[pods.gpus]]\nuuid = \"{long}\"\n"),
        format!(
            "[[pods]]\nid = \"a\"\ntoken = \"x\"\n[[pods.gpus]]\nindex = 0\nclass = \"{long}\"\n"
        ),
        format!(
            "[[pods]]\nid = \"a\"\ntoken = \"x\"\n[[pods.gpus]]\nindex = 0\npolicy = \"{long}\"\n"
        ),
        format!(
            "[[pods]]\nid = \"a\"\ntoken = \"x\"\n[[pods.gpus]]\nindex = 0\nmemory = \"{long}\"\n"
        ),
        format!("listen = \"{long}\n"),
        format!("listen = {long}\n"),
    ];
    let too_much = "x".repeat(201);
    for text in cases {
        let error = parse_str(&text).unwrap_err().to_string();
        assert!(
            !error.contains(&too_much) && !error.contains('\n'),
            "{}: {error}",
            &text[..40]
        );
    }
}

#[test]
fn the_swap_table() {
    let defaults = parse_str("").unwrap().settings.swap;
    assert!(!defaults.overcommits(0), "overcommit is opt-in");
    assert_eq!(defaults.idle_after, Duration::from_secs(30));
    assert_eq!(defaults.cuda_library, "libcuda.so.1");
    assert!(!defaults.drain_unhealthy, "draining is opt-in");
    assert_eq!(defaults.ranking, hypervisor_swap::Ranking::Lru2);
    assert_eq!(defaults.min_resident, Duration::from_secs(5));
    assert_eq!(defaults.headroom, 0, "no swap-out ahead of need");
    assert_eq!(
        defaults.prepare_ahead, 0,
        "no copies ahead without headroom"
    );
    let all = parse_str(
        r#"
        [swap]
        overcommit = true
        idle_after_ms = 2500
        latency_pods = "never"
        ranking = "lru"
        min_resident_ms = 750
        headroom = "12g"
        host_limit = "64g"
        room_wait_ms = 9000
        prepare_ahead = "40g"
        cuda_library = "/opt/driver/libcuda.so.1"
        drain_unhealthy = true
        "#,
    )
    .unwrap()
    .settings
    .swap;
    assert!(all.overcommits(0) && all.overcommits(7));
    assert_eq!(all.idle_after, Duration::from_millis(2500));
    assert_eq!(all.latency_pods, hypervisor_swap::LatencyPods::Never);
    assert_eq!(all.ranking, hypervisor_swap::Ranking::Lru);
    assert_eq!(all.min_resident, Duration::from_millis(750));
    assert_eq!(all.headroom, 12 << 30);
    assert_eq!(all.host_limit, 64 << 30);
    assert_eq!(all.room_wait, Duration::from_secs(9));
    assert_eq!(all.prepare_ahead, 40 << 30);
    let headroom = parse_str("[swap]\nheadroom = \"12g\"\n").unwrap();
    assert_eq!(
        headroom.settings.swap.prepare_ahead,
        24 << 30,
        "twice headroom"
    );
    assert_eq!(all.cuda_library, "/opt/driver/libcuda.so.1");
    assert!(all.drain_unhealthy);
    let some = parse_str("[swap]\novercommit = [1, 3]\n")
        .unwrap()
        .settings
        .swap;
    assert!(!some.overcommits(0) && some.overcommits(1) && some.overcommits(3));
    for bad in [
        "[swap]\nlatency_pods = \"first\"\n",
        "[swap]\nhost_limit = \"lots\"\n",
        "[swap]\nheadroom = \"lots\"\n",
        "[swap]\nprepare_ahead = true\n",
        "[swap]\nranking = \"lfu\"\n",
        "[swap]\nidle = 3\n",
    ] {
        assert!(parse_str(bad).is_err(), "{bad}");
    }
    let error = parse_str("[swap]\nlatency_pods = \"first\"\n").unwrap_err();
    assert_eq!(
        error.to_string(),
        "[swap]: invalid latency_pods = \"first\""
    );
}

#[test]
fn the_overcommit_ratio_sets_what_overcommitting_gpus_offer() {
    const GIB: u64 = 1 << 30;
    // Without overcommit, every GPU offers its own memory, whatever the ratio.
    let off = parse_str("[swap]\novercommit_ratio = 1.5\n")
        .unwrap()
        .settings
        .swap;
    assert_eq!(off.memory_capacity().of(0, 16 * GIB), 16 * GIB);
    // Overcommit on, no ratio: twice the memory.
    let default = parse_str("[swap]\novercommit = true\n")
        .unwrap()
        .settings
        .swap;
    assert_eq!(default.overcommit_ratio, OvercommitRatio::DEFAULT);
    assert_eq!(default.memory_capacity().of(3, 16 * GIB), 32 * GIB);
    let some = parse_str("[swap]\novercommit = [0]\novercommit_ratio = 1.5\n")
        .unwrap()
        .settings
        .swap;
    let capacity = some.memory_capacity();
    assert_eq!(
        (capacity.of(0, 16 * GIB), capacity.of(1, 16 * GIB)),
        (24 * GIB, 16 * GIB)
    );
    // A whole number is a ratio too.
    let two = parse_str("[swap]\novercommit = true\novercommit_ratio = 3\n")
        .unwrap()
        .settings
        .swap;
    assert_eq!(two.memory_capacity().of(0, GIB), 3 * GIB);
    for bad in ["0.5", "0", "-2", "150", "\"1.5\"", "nan", "inf"] {
        let text = format!("[swap]\novercommit = true\novercommit_ratio = {bad}\n");
        assert!(parse_str(&text).is_err(), "{bad}");
    }
    let error = parse_str("[swap]\novercommit_ratio = 0.5\n")
        .unwrap_err()
        .to_string();
    assert_eq!(
        error,
        "[swap]: invalid overcommit_ratio = 0.5: a ratio from 1 to 10 (1.5: quotas up to one and a half times the memory)"
    );
}
