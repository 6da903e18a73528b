use super::*;

const SECOND: Duration = Duration::from_secs(1);

/// A checkpoint swap of `bytes` that took a second.
fn checkpoint(bytes: u64) -> Swapped {
    Swapped {
        path: SwapPath::Checkpoint,
        bytes,
        took: SECOND,
        kept: 0,
    }
}

fn report(board: &SwapBoard, residencies: &[(&str, Residency)]) -> SwapReport {
    board.report(residencies.iter().copied())
}

#[test]
fn a_pod_is_reported_where_its_limits_say_whatever_the_board_saw() {
    let board = SwapBoard::default();
    board.swapped_out("a", checkpoint(5));
    let away = report(&board, &[("a", Residency::Swapped)]);
    assert_eq!(away.pods["a"].state, Residency::Swapped);
    assert_eq!(away.pods["a"].history.bytes_on_host, 5);
    assert_eq!(
        (away.totals.swapped_pods, away.totals.bytes_on_host),
        (1, 5)
    );
    // Its limits say resident, with no swap-in on the board: it is on its
    // GPUs, and nothing of it is counted in host memory.
    let back = report(&board, &[("a", Residency::Resident)]);
    assert_eq!(back.pods["a"].state, Residency::Resident);
    assert_eq!(back.pods["a"].history.bytes_on_host, 0);
    assert_eq!(
        (back.totals.swapped_pods, back.totals.bytes_on_host),
        (0, 0)
    );
    assert_eq!(back.totals.swap_outs, 1, "its history stays");
    let moving = report(&board, &[("a", Residency::SwappingIn)]);
    assert_eq!(moving.pods["a"].state, Residency::SwappingIn);
    assert_eq!(moving.totals.swapped_pods, 1);
}

#[test]
fn a_pod_away_that_the_board_never_saw_is_reported_away() {
    let board = SwapBoard::default();
    let found = report(
        &board,
        &[("b", Residency::Swapped), ("c", Residency::Resident)],
    );
    assert_eq!(found.pods["b"].state, Residency::Swapped);
    assert_eq!(found.totals.swapped_pods, 1);
    assert!(!found.pods.contains_key("c"), "never swapped: {found:?}");
    board.found_away("b", 7);
    assert_eq!(
        report(&board, &[("b", Residency::Swapped)])
            .totals
            .bytes_on_host,
        7
    );
    // The board's own figure stands once it has one.
    board.found_away("b", 9);
    assert_eq!(board.history("b").bytes_on_host, 7);
    board.processes_gone("b");
    let gone = report(&board, &[("b", Residency::Resident)]);
    assert_eq!(
        (gone.totals.swapped_pods, gone.totals.bytes_on_host),
        (0, 0)
    );
}

#[test]
fn only_the_pods_named_are_reported() {
    let board = SwapBoard::default();
    board.swapped_out("gone", checkpoint(3));
    board.swapped_out("here", checkpoint(4));
    let only = report(&board, &[("here", Residency::Swapped)]);
    assert_eq!(only.pods.keys().collect::<Vec<_>>(), ["here"]);
    assert_eq!(only.totals.bytes_on_host, 4);
    assert_eq!(only.totals.swap_outs, 2, "the node's counts are the node's");
    board.forget("gone");
    let forgotten = report(&board, &[("gone", Residency::Resident)]);
    assert!(forgotten.pods.is_empty(), "{forgotten:?}");
}

#[test]
fn a_failure_keeps_the_bytes_of_a_pod_left_away_only() {
    let board = SwapBoard::default();
    board.swapped_out("a", checkpoint(5));
    board.failed("a", Residency::Swapped, "restore refused");
    assert_eq!(board.history("a").bytes_on_host, 5);
    assert_eq!(
        board.history("a").last_error.as_deref(),
        Some("restore refused")
    );
    board.failed("a", Residency::Resident, "lock refused");
    let history = board.history("a");
    assert_eq!((history.bytes_on_host, history.failures), (0, 2));
    board.swapped_in("a", checkpoint(5));
    assert_eq!(board.history("a").last_error, None);
}

#[test]
fn each_swap_records_its_path_and_bytes_each_way() {
    let board = SwapBoard::default();
    let fast = |bytes| Swapped {
        path: SwapPath::Fast,
        bytes,
        took: SECOND,
        kept: bytes,
    };
    board.swapped_out("a", fast(7));
    board.swapped_in("a", fast(7));
    board.swapped_out("a", checkpoint(9));
    let history = board.history("a");
    assert_eq!(history.last_swap_out_path, Some(SwapPath::Checkpoint));
    assert_eq!(history.last_swap_in_path, Some(SwapPath::Fast));
    assert_eq!((history.last_bytes_out, history.last_bytes_in), (9, 7));
    let totals = report(&board, &[("a", Residency::Swapped)]).totals;
    assert_eq!((totals.swap_outs, totals.fast_swap_outs), (2, 1));
    assert_eq!((totals.swap_ins, totals.fast_swap_ins), (1, 1));
    assert_eq!((totals.bytes_out, totals.bytes_in), (16, 7));
}

#[test]
fn kept_host_copies_count_while_resident_and_become_the_bytes_on_host_when_away() {
    let board = SwapBoard::default();
    let fast = |bytes, kept| Swapped {
        path: SwapPath::Fast,
        bytes,
        took: SECOND,
        kept,
    };
    board.swapped_out("a", fast(8, 8));
    board.swapped_in("a", fast(8, 8));
    board.swapped_out("b", fast(5, 5));
    let both = [("a", Residency::Resident), ("b", Residency::Swapped)];
    let seen = report(&board, &both);
    assert_eq!(seen.totals.host_kept_bytes, 8);
    assert_eq!(seen.totals.bytes_on_host, 5);
    assert_eq!(seen.pods["a"].history.host_kept_bytes, 8);
    // Away, a pod's copies are its bytes in host memory, not kept ones.
    assert_eq!(seen.pods["b"].history.host_kept_bytes, 0);

    board.host_kept("a", 2);
    assert_eq!(report(&board, &both).totals.host_kept_bytes, 2);
    // A swap-out uses the kept copies: they are the bytes on host now.
    board.swapped_out("a", fast(8, 8));
    let away = report(
        &board,
        &[("a", Residency::Swapped), ("b", Residency::Swapped)],
    );
    assert_eq!(away.totals.host_kept_bytes, 0);
    assert_eq!(away.totals.bytes_on_host, 13);
    // The processes gone, nothing of theirs stays in host memory.
    board.swapped_in("a", fast(8, 8));
    board.processes_gone("a");
    assert_eq!(report(&board, &both).totals.host_kept_bytes, 0);
}
