//! Random workloads under random impairments keep the transport's promises: every
//! operation completes exactly once, in order, with success; every byte lands where it
//! should and nowhere else (the workload checks each write against the operations in
//! flight); atomics execute exactly once (their fetched values and the final counter are
//! checked).

use proptest::prelude::*;
use softrdma_proto::qp::Mtu;
use softrdma_proto::sim::{run_workload, ConnectParams, Impairments, WorkloadConfig};

fn mtu() -> impl Strategy<Value = Mtu> {
    prop_oneof![
        Just(Mtu::Mtu256),
        Just(Mtu::Mtu512),
        Just(Mtu::Mtu1024),
        Just(Mtu::Mtu2048),
        Just(Mtu::Mtu4096)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn random_workloads_keep_every_invariant(
        seed in any::<u64>(),
        loss in 0.0f64..15.0,
        dup in 0.0f64..5.0,
        reorder in 0.0f64..10.0,
        corrupt in 0.0f64..3.0,
        depth in 1usize..32,
        max_size in 8usize..20_000,
        mtu in mtu(),
        selective in any::<bool>(),
    ) {
        let cfg = WorkloadConfig {
            ops: 300,
            seed,
            impairments: Impairments::from_percent(loss, dup, reorder, corrupt),
            depth,
            max_size,
            params: ConnectParams { mtu, selective, ..ConnectParams::default() },
            ..WorkloadConfig::default()
        };
        let r = run_workload(cfg);
        prop_assert_eq!(r.completed, 300, "{:?}", r.problems);
        prop_assert_eq!((r.data_errors, r.status_errors), (0, 0), "{:?}", r.problems);
    }
}

#[test]
fn the_issue_scenario_for_several_seeds() {
    // `softrdma sim --loss 10 --dup 2 --reorder 5 --corrupt 1`, shorter, as a regression test.
    for seed in [1, 7, 1234, u64::MAX] {
        let cfg = WorkloadConfig {
            ops: 2000,
            seed,
            impairments: Impairments::from_percent(10.0, 2.0, 5.0, 1.0),
            ..WorkloadConfig::default()
        };
        let r = run_workload(cfg);
        assert_eq!(
            (r.completed, r.data_errors, r.status_errors),
            (2000, 0, 0),
            "seed {seed}: {:?}",
            r.problems
        );
        assert!(r.net.lost > 0 && r.net.corrupted > 0 && r.net.duplicated > 0 && r.net.reordered > 0);
        assert!(r.requester.retransmits > 0);
    }
}

#[test]
fn packets_delayed_past_the_ack_timeout() {
    // 5% of datagrams arrive up to 60 ms late, far past the 16.8 ms ACK timeout and the
    // probe timeout: spurious resends, probes, timeouts and go-backs, and ACKs for packets
    // the requester is already resending.
    for seed in 0..8 {
        let imp = Impairments {
            reorder: 0.05,
            jitter: std::time::Duration::from_millis(60),
            ..Impairments::default()
        };
        let r =
            run_workload(WorkloadConfig { ops: 1500, seed, impairments: imp, ..WorkloadConfig::default() });
        assert_eq!(
            (r.completed, r.data_errors, r.status_errors),
            (1500, 0, 0),
            "seed {seed}: {:?}",
            r.problems
        );
        // (Resent by a probe, or by the resend timer once SACKs showed the delayed ones
        // missing.)
        assert!(r.requester.retransmits > 0, "the delays caused spurious resends");
    }
}

/// The checker fires: each injected fault is reported, and the same run without it is
/// clean. Loss and duplication make the network retransmit and duplicate meanwhile.
#[test]
fn the_checker_reports_every_injected_fault() {
    use softrdma_proto::sim::{run_workload_with_fault, Fault, MemFault};
    let cfg = WorkloadConfig {
        ops: 600,
        seed: 11,
        impairments: Impairments::from_percent(2.0, 1.0, 2.0, 0.5),
        depth: 8,
        max_size: 8192,
        ..WorkloadConfig::default()
    };
    let clean = run_workload(cfg);
    assert_eq!(
        (clean.completed, clean.data_errors, clean.status_errors),
        (600, 0, 0),
        "{:?}",
        clean.problems
    );
    let mem = |node, fault, nth| Fault::Memory { node, fault, nth };
    let faults = [
        // Data: the checker must count a data error.
        (mem(1, MemFault::FetchAddTwice, 20), true),
        (mem(1, MemFault::WriteOutside, 50), true),
        (mem(0, MemFault::WriteOutside, 30), true),
        (mem(1, MemFault::CorruptPayload, 70), true),
        (mem(0, MemFault::CorruptPayload, 40), true),
        (Fault::LateWrite(100), true),
        (Fault::LateWrite(400), true),
        // Completions: a status error.
        (Fault::DropCompletion(100), false),
        (Fault::SwapCompletions(100), false),
        (Fault::DeliverTwice(50), false),
        (Fault::TrailingCompletion, false),
    ];
    for (fault, data) in faults {
        let r = run_workload_with_fault(cfg, fault);
        let seen = if data { r.data_errors } else { r.status_errors };
        assert!(seen > 0, "{fault:?} went unreported: {:?}", r.problems);
        eprintln!("{fault:?}: {}", r.problems[0]);
    }
}
