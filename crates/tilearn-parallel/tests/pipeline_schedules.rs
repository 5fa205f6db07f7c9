//! Pipeline schedules without any communication: every kind over p ≤ 8 stages and m ≤ 32
//! micro-batches validates, simulates without deadlock, has the formula's bubble and the memory
//! profile that motivates it; broken schedules fail with errors that point at the broken action.

use tilearn_parallel::pipeline::{
    Action, Costs, P2pKind, Schedule, ScheduleError, ScheduleKind, render_timeline,
};

/// Every (kind, stages, micro-batches) of the range; interleaving with 1 to 3 chunks.
fn all_shapes() -> impl Iterator<Item = (ScheduleKind, usize, usize)> {
    let kinds = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved { virtual_stages: 1 },
        ScheduleKind::Interleaved { virtual_stages: 2 },
        ScheduleKind::Interleaved { virtual_stages: 3 },
    ];
    kinds
        .into_iter()
        .flat_map(|kind| (1..=8).flat_map(move |p| (1..=32).map(move |m| (kind, p, m))))
}

fn is_interleaved(kind: ScheduleKind) -> bool {
    matches!(kind, ScheduleKind::Interleaved { .. })
}

/// The schedules the kinds accept; the shapes interleaving rejects are checked to fail with the
/// error that names the fix.
fn buildable() -> Vec<Schedule> {
    let mut built = Vec::new();
    for (kind, p, m) in all_shapes() {
        match Schedule::build(kind, p, m) {
            Ok(schedule) => built.push(schedule),
            Err(ScheduleError::Config { field, reason, .. })
                if is_interleaved(kind) && !m.is_multiple_of(p) =>
            {
                assert_eq!(field, "micro_batches");
                assert!(reason.contains(&format!("multiple of {p}")), "{reason}");
            }
            Err(e) => panic!("{kind} p={p} m={m}: {e}"),
        }
    }
    built
}

#[test]
fn every_schedule_validates_and_simulates_without_deadlock() {
    let schedules = buildable();
    // 256 GPipe + 256 1F1B + 85 interleaved shapes for each of 3 chunk counts.
    assert_eq!(schedules.len(), 256 * 2 + 85 * 3);
    let uneven = Costs {
        forward: 0.7,
        backward: 1.9,
        p2p: 0.3,
    };
    for s in &schedules {
        let label = format!("{} p={} m={}", s.kind, s.stages, s.micro_batches);
        s.validate().unwrap_or_else(|e| panic!("{label}: {e}"));
        for costs in [Costs::default(), uneven] {
            let t = s
                .simulate(&costs)
                .unwrap_or_else(|e| panic!("{label}: {e}"));
            let computes = 2 * s.micro_batches * s.model_chunks();
            for stage in 0..s.stages {
                let done = t.spans[stage].iter().filter(|x| x.is_compute()).count();
                assert_eq!(done, computes, "{label} stage {stage}");
            }
        }
    }
}

#[test]
fn simulated_bubble_equals_the_formula_exactly() {
    // Whole-number forward and backward costs and free p2p: every time is a whole number, so idle
    // and busy sums are exact and their quotient rounds like the formula's (p-1)/(m·v): equality,
    // no tolerance. It holds for every m, also m < p (where 1F1B degenerates to GPipe), for
    // interleaving, and whatever the backward/forward ratio.
    for s in buildable() {
        let formula = (s.stages - 1) as f64 / (s.micro_batches * s.model_chunks()) as f64;
        assert_eq!(s.bubble_fraction_formula(), formula);
        for (forward, backward) in [(1.0, 2.0), (1.0, 1.0), (2.0, 3.0)] {
            let costs = Costs {
                forward,
                backward,
                p2p: 0.0,
            };
            let t = s.simulate(&costs).unwrap();
            let label = format!(
                "{} p={} m={} F={forward} B={backward}",
                s.kind, s.stages, s.micro_batches
            );
            assert_eq!(t.bubble_fraction(), formula, "{label}");
            // Per stage too: each computes the same, so each idles (p-1)/(m·v) of its busy time.
            for stage in 0..s.stages {
                assert_eq!(
                    t.idle(stage) / t.busy(stage),
                    formula,
                    "{label} stage {stage}"
                );
            }
        }
    }
}

#[test]
fn one_f_one_b_holds_at_most_p_minus_s_micro_batches_and_gpipe_all() {
    for p in 1..=8 {
        for m in 1..=32 {
            let gpipe = Schedule::build(ScheduleKind::GPipe, p, m).unwrap();
            let one_f_one_b = Schedule::build(ScheduleKind::OneFOneB, p, m).unwrap();
            for s in 0..p {
                assert_eq!(gpipe.peak_in_flight(s), m, "GPipe p={p} m={m} stage {s}");
                let peak = one_f_one_b.peak_in_flight(s);
                assert!(peak <= p - s, "1F1B p={p} m={m} stage {s}: {peak}");
                assert_eq!(peak, (p - s).min(m), "1F1B p={p} m={m} stage {s}");
            }
        }
    }
    // Interleaving keeps Megatron's warm-up: 2(p-s-1) + (v-1)p forwards, then one more.
    for v in 1..=3 {
        let s = Schedule::build(ScheduleKind::Interleaved { virtual_stages: v }, 4, 16).unwrap();
        for stage in 0..4 {
            let expected = (2 * (4 - stage - 1) + (v - 1) * 4 + 1).min(16 * v);
            assert_eq!(s.peak_in_flight(stage), expected, "v={v} stage {stage}");
        }
    }
}

#[test]
fn sizes_that_cannot_work_are_rejected_by_name() {
    let err = |kind, p, m| Schedule::build(kind, p, m).unwrap_err().to_string();
    assert_eq!(
        err(ScheduleKind::GPipe, 0, 4),
        "stages = 0: a pipeline needs at least 1 stage"
    );
    assert!(err(ScheduleKind::OneFOneB, 4, 0).starts_with("micro_batches = 0: "));
    assert_eq!(
        err(ScheduleKind::Interleaved { virtual_stages: 0 }, 2, 4),
        "virtual_stages = 0: interleaving needs at least 1 model chunk per stage"
    );
    assert_eq!(
        err(ScheduleKind::Interleaved { virtual_stages: 2 }, 4, 6),
        "micro_batches = 6: interleaved 1F1B runs micro-batches in groups of the 4 stages, so it \
         needs a multiple of 4 (as Megatron does): use 4 or 8"
    );
    assert!(err(ScheduleKind::Interleaved { virtual_stages: 2 }, 4, 3).ends_with("use 4"));
    // Sizes nobody means fail before anything is allocated for them.
    assert!(err(ScheduleKind::GPipe, 8, usize::MAX).starts_with("micro_batches = "));
    assert!(err(ScheduleKind::OneFOneB, usize::MAX / 2, 4).contains("a schedule may hold"));
    let mut hand_made = Schedule::build(ScheduleKind::GPipe, 4, 4).unwrap();
    hand_made.actions.pop();
    assert_eq!(
        hand_made.validate().unwrap_err().to_string(),
        "actions = 3: one program per stage is needed, and there are 4 stages"
    );
    let s = Schedule::build(ScheduleKind::OneFOneB, 2, 2).unwrap();
    for (costs, field) in [
        (
            Costs {
                forward: 0.0,
                ..Costs::default()
            },
            "forward cost",
        ),
        (
            Costs {
                backward: f64::NAN,
                ..Costs::default()
            },
            "backward cost",
        ),
        (
            Costs {
                p2p: -1.0,
                ..Costs::default()
            },
            "p2p cost",
        ),
    ] {
        match s.simulate(&costs) {
            Err(ScheduleError::Config { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{field}: {other:?}"),
        }
    }
}

/// The index of the first action on `stage` that satisfies `pred`.
fn find(s: &Schedule, stage: usize, pred: impl Fn(&Action) -> bool) -> usize {
    s.actions[stage].iter().position(pred).unwrap()
}

#[test]
fn a_dropped_receive_is_named_by_validate_and_by_simulate() {
    let mut s = Schedule::build(ScheduleKind::OneFOneB, 4, 8).unwrap();
    let comm = find(
        &s,
        2,
        |a| matches!(a, Action::Comm(ops) if ops.iter().any(|o| o.kind == P2pKind::RecvActivation)),
    );
    let Action::Comm(ops) = &mut s.actions[2][comm] else {
        unreachable!()
    };
    ops.retain(|o| o.kind != P2pKind::RecvActivation);
    if ops.is_empty() {
        s.actions[2].remove(comm);
    }
    let forward = find(&s, 2, |a| {
        matches!(a, Action::Forward { micro_batch: 0, .. })
    });
    assert_eq!(
        s.validate().unwrap_err(),
        ScheduleError::Invalid {
            stage: 2,
            action: forward,
            reason: "forward of micro-batch 0 chunk 0: runs before its activation from stage 1 \
                     is received"
                .into()
        }
    );
    let err = s.simulate(&Costs::default()).unwrap_err();
    match &err {
        ScheduleError::Unpaired {
            from: 1,
            to: 2,
            reason,
        } => {
            // Every later message of the link shifts by one, so the first pair disagrees.
            assert!(reason.starts_with("message 0: stage 1 action "), "{reason}");
            assert!(
                reason.contains("send activation of micro-batch 0"),
                "{reason}"
            );
            assert!(
                reason.contains("recv activation of micro-batch 1"),
                "{reason}"
            );
        }
        other => panic!("{other}"),
    }
}

#[test]
fn swapped_batches_deadlock_and_the_error_names_both_stuck_stages() {
    // GPipe, 2 stages, 1 micro-batch: stage 0 is [F0, send activation, recv gradient, B0].
    let mut s = Schedule::build(ScheduleKind::GPipe, 2, 1).unwrap();
    assert_eq!(s.actions[0].len(), 4);
    s.actions[0].swap(1, 2); // waits for the gradient before sending the activation
    let expected = ScheduleError::Deadlock(
        "stage 0 is stuck at action 1 (comm [recv gradient of micro-batch 0 chunk 0 from stage \
         1]) waiting for stage 1 to reach its action 3 (comm [send gradient of micro-batch 0 \
         chunk 0 to stage 0]); stage 1 is stuck at action 0 (comm [recv activation of \
         micro-batch 0 chunk 0 from stage 0]) waiting for stage 0 to reach its action 2 (comm \
         [send activation of micro-batch 0 chunk 0 to stage 1])"
            .into(),
    );
    assert_eq!(s.simulate(&Costs::default()).unwrap_err(), expected);
    // Every action is still in a possible place, so only the replay in validate catches it.
    assert_eq!(s.validate().unwrap_err(), expected);
}

#[test]
fn a_compute_moved_before_its_receive_or_its_forward_is_caught() {
    let base = Schedule::build(ScheduleKind::OneFOneB, 3, 4).unwrap();

    let mut s = base.clone();
    let forward = find(&s, 1, |a| {
        matches!(a, Action::Forward { micro_batch: 1, .. })
    });
    assert!(matches!(s.actions[1][forward - 1], Action::Comm(_)));
    s.actions[1].swap(forward - 1, forward);
    assert_eq!(
        s.validate().unwrap_err().to_string(),
        format!(
            "stage 1, action {}: forward of micro-batch 1 chunk 0: runs before its activation \
             from stage 0 is received",
            forward - 1
        )
    );

    let mut s = base.clone();
    let last_backward = s.actions[2]
        .iter()
        .rposition(|a| matches!(a, Action::Backward { .. }))
        .unwrap();
    let backward = s.actions[2][last_backward].clone();
    s.actions[2].insert(0, backward); // a backward first
    let err = s.validate().unwrap_err();
    assert!(
        matches!(&err, ScheduleError::Invalid { stage: 2, action: 0, reason }
            if reason.ends_with("runs before its forward")),
        "{err}"
    );

    let mut s = base.clone();
    let backward = find(&s, 0, |a| {
        matches!(a, Action::Backward { micro_batch: 3, .. })
    });
    s.actions[0].remove(backward);
    assert_eq!(
        s.validate().unwrap_err(),
        ScheduleError::Incomplete {
            stage: 0,
            missing: "the backward of micro-batch 3 chunk 0".into()
        }
    );

    let mut s = base;
    let forward = find(&s, 0, |a| {
        matches!(a, Action::Forward { micro_batch: 0, .. })
    });
    let again = s.actions[0][forward].clone();
    s.actions[0].insert(forward, again);
    assert!(
        s.validate()
            .unwrap_err()
            .to_string()
            .ends_with("runs a second time")
    );
}

#[test]
fn misaddressed_and_reordered_messages_are_caught() {
    let base = Schedule::build(ScheduleKind::OneFOneB, 3, 4).unwrap();

    // A send to the wrong neighbour.
    let mut s = base.clone();
    let comm = find(&s, 0, |a| matches!(a, Action::Comm(_)));
    let Action::Comm(ops) = &mut s.actions[0][comm] else {
        unreachable!()
    };
    ops[0].peer_stage = 2;
    assert_eq!(
        s.validate().unwrap_err().to_string(),
        format!(
            "stage 0, action {comm}: send activation of micro-batch 0 chunk 0 to stage 2: the \
             other end is stage 1 (global chunk 1), not stage 2"
        )
    );

    // Two batches of one link posted in the other order on one end only.
    let mut s = base;
    let comms: Vec<usize> = (0..s.actions[2].len())
        .filter(|&i| matches!(s.actions[2][i], Action::Comm(_)))
        .collect();
    let (first, second) = (comms[0], comms[1]);
    let (a, b) = (s.actions[2][first].clone(), s.actions[2][second].clone());
    s.actions[2][first] = b;
    s.actions[2][second] = a;
    let err = s.simulate(&Costs::default()).unwrap_err();
    assert!(
        matches!(&err, ScheduleError::Unpaired { from: 1, to: 2, reason }
            if reason.starts_with("message 0:") && reason.contains("same order")),
        "{err}"
    );
}

#[test]
fn one_stage_interleaving_keeps_chunk_to_chunk_tensors_local() {
    let s = Schedule::build(ScheduleKind::Interleaved { virtual_stages: 3 }, 1, 2).unwrap();
    assert!(s.actions[0].iter().all(|a| !matches!(a, Action::Comm(_))));
    assert_eq!(s.actions[0].len(), 12);
    assert_eq!(
        s.simulate(&Costs::default()).unwrap().bubble_fraction(),
        0.0
    );
}

#[test]
fn global_chunks_interleave_across_stages() {
    let s = Schedule::build(ScheduleKind::Interleaved { virtual_stages: 2 }, 4, 8).unwrap();
    assert_eq!(s.model_chunks(), 2);
    assert_eq!(s.global_chunk(3, 0), 3);
    assert_eq!(s.global_chunk(0, 1), 4); // the last stage's chunk 0 feeds stage 0's chunk 1
    for g in 0..8 {
        let (stage, chunk) = s.chunk_owner(g).unwrap();
        assert_eq!(s.global_chunk(stage, chunk), g);
    }
    assert_eq!(s.chunk_owner(8), None);
    // Stage 3 sends its chunk-0 activations to stage 0, which receives them into chunk 1.
    let wraps = s.actions[0].iter().flat_map(|a| match a {
        Action::Comm(ops) => ops.clone(),
        _ => Vec::new(),
    });
    let from_last: Vec<_> = wraps
        .filter(|o| o.kind == P2pKind::RecvActivation)
        .map(|o| (o.peer_stage, o.chunk, o.micro_batch))
        .collect();
    assert_eq!(from_last, (0..8).map(|mb| (3, 1, mb)).collect::<Vec<_>>());
}

#[test]
fn p2p_cost_lengthens_the_step() {
    let s = Schedule::build(ScheduleKind::OneFOneB, 4, 8).unwrap();
    let free = s.simulate(&Costs::default()).unwrap();
    let paid = s
        .simulate(&Costs {
            p2p: 0.5,
            ..Costs::default()
        })
        .unwrap();
    assert_eq!(free.makespan, (8.0 + 3.0) * 3.0);
    assert!(paid.makespan > free.makespan);
    assert!(paid.bubble_fraction() > free.bubble_fraction());
}

#[test]
fn render_draws_one_row_per_stage_with_legend_and_bubble() {
    let s = Schedule::build(ScheduleKind::OneFOneB, 2, 2).unwrap();
    let t = s.simulate(&Costs::default()).unwrap();
    // Makespan 9 on 18 columns: two per time unit. Stage 0 waits for the first gradient from
    // 2 to 4 and for the second from 6 to 7; stage 1 starts at 1 and is done at 7.
    let text = render_timeline(&t, 18);
    let expected = "\
1F1B: 2 stages, 2 micro-batches, step time 9 (0.500 per column)
stage 0 |F0F1....B0bb..B1bb|
stage 1 |..F0B0bbF1B1bb....|
";
    assert!(text.starts_with(expected), "{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 5);
    assert!(lines[3].starts_with("legend: Fm = forward of micro-batch m"));
    assert_eq!(
        lines[4],
        "bubble fraction: 0.5000 (idle / compute time over all stages); formula (p-1)/m = 0.5000"
    );

    let s = Schedule::build(ScheduleKind::Interleaved { virtual_stages: 2 }, 4, 8).unwrap();
    let t = s.simulate(&Costs::default()).unwrap();
    let text = render_timeline(&t, 240);
    let rows: Vec<&str> = text.lines().filter(|l| l.starts_with("stage ")).collect();
    assert_eq!(rows.len(), 4);
    for row in rows {
        let inner = row.split('|').nth(1).unwrap();
        assert_eq!(inner.chars().count(), 240, "{row}");
    }
    assert!(text.contains("F0:1"), "{text}");
    assert!(text.contains("formula (p-1)/(m*v) = 0.1875"), "{text}");
}
