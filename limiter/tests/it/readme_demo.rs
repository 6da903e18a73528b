//! The README's demo output is what `scripts/demo.sh` prints on a machine
//! without an NVIDIA driver: the same probe script, run by the same lines,
//! against the driver double, without and with the limiter's 4 GiB quota.
//! The script's own build step is left out (the test uses this build).

use crate::common;

use common::{Pod, run, use_node_tables};

const README: &str = include_str!("../../../README.md");
const DEMO: &str = include_str!("../../../scripts/demo.sh");

/// The lines of the README's first `text` block after `marker`.
fn readme_block(marker: &str) -> Vec<&'static str> {
    let after = README
        .split_once(marker)
        .unwrap_or_else(|| panic!("the README says {marker:?}"))
        .1;
    let block = after
        .split_once("```text\n")
        .and_then(|(_, rest)| rest.split_once("```"))
        .expect("a text block after it")
        .0;
    block.lines().collect()
}

/// The text of each `echo "..."` line of the demo script, in order.
fn demo_echoes() -> Vec<&'static str> {
    DEMO.lines()
        .filter_map(|line| line.trim().strip_prefix("echo \"")?.strip_suffix('"'))
        .collect()
}

/// The probe's arguments: the demo script's `script=(...)` array.
fn demo_script() -> Vec<&'static str> {
    DEMO.lines()
        .find_map(|line| line.strip_prefix("script=(")?.strip_suffix(')'))
        .expect("the demo's script=(...) line")
        .split_whitespace()
        .collect()
}

#[test]
fn the_demo_prints_what_the_readme_shows() {
    let pod = Pod::new("readme-demo");
    let script = demo_script();
    let probe = |limited: bool| {
        let mut command = gpushare_examples::command("cudaprobe");
        command
            .args(&script)
            .env_remove("LD_PRELOAD")
            .env_remove("GPUSHARE_DOUBLE_TOTAL")
            .env_remove("CUDA_LIMITER_LOG");
        use_node_tables(&mut command, &pod);
        if limited {
            command
                .env("LD_PRELOAD", common::limiter())
                .env("CUDA_DEVICE_MEMORY_LIMIT", "4g")
                .env("CUDA_LIMITER_POD", &pod.0);
        }
        run(command)
    };
    let echoes = demo_echoes();
    let [_, double, without, with] = echoes[..] else {
        panic!("the demo's echo lines changed: {echoes:?}");
    };
    assert!(double.contains("double"), "{echoes:?}");
    let mut printed = vec![double.to_owned(), without.to_owned()];
    printed.extend(probe(false));
    printed.push(with.to_owned());
    printed.extend(probe(true));
    assert_eq!(
        readme_block("with\nthe double it prints:"),
        printed,
        "the README's demo output against what the demo prints here"
    );
}
