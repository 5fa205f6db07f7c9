//! The row cache of tables larger than the device (`cache`): the LRU slot policy, and training
//! through a cache smaller than the tables giving the weights and optimizer state of training
//! on the whole tables, bit for bit (each row's update sees the same contributions in the same
//! order; only the rows' places differ), with rows evicted and written back along the way.

mod common;

use common::{odd_layout, random_batch, random_values};
use tilearn_recsys::cache::{
    BatchCopies, CachedEmbeddingBag, HostRows, LruSlots, RowCachePlanner, RowMove, SlotPlan,
    parse_bytes, plan_residency,
};
use tilearn_recsys::{
    EmbeddingTables, JaggedBatch, Pooling, SparseOptimizer, SparseState, TableLayout, TableSpec,
    embedding_bag_backward_update, embedding_bag_forward,
};

/// Table 0: 10 rows of dim 3 behind 2 slots; table 1: 4 rows of dim 2, resident (4 slots).
fn two_tables() -> TableLayout {
    TableLayout::new(vec![
        TableSpec {
            rows: 10,
            dim: 3,
            pooling: Pooling::Sum,
        },
        TableSpec {
            rows: 4,
            dim: 2,
            pooling: Pooling::Sum,
        },
    ])
    .unwrap()
}

/// A batch of 2 samples: table 0's bags `a`, table 1's bags `b`.
fn batch_of(layout: &TableLayout, a: [&[u32]; 2], b: [&[u32]; 2]) -> JaggedBatch {
    let mut offsets = vec![0u32];
    let mut ids = Vec::new();
    for bag in a.into_iter().chain(b) {
        ids.extend_from_slice(bag);
        offsets.push(ids.len() as u32);
    }
    JaggedBatch::new(layout, 2, offsets, ids).unwrap()
}

#[test]
fn planner_loads_new_rows_writes_back_only_dirty_evictions_and_leaves_resident_tables_alone() {
    let layout = two_tables();
    let mut planner = RowCachePlanner::new(&layout, &[2, 4]).unwrap();
    assert_eq!(planner.resident_tables(), vec![1]);
    // Rows seen for the first time: loaded into free slots in first-use order, nothing evicted;
    // the resident table's ids pass through unchanged and move nothing.
    let (moves, mapped) = planner
        .map_batch(&batch_of(&layout, [&[7], &[3, 7]], [&[3], &[0, 2]]), true)
        .unwrap();
    assert_eq!(
        moves,
        vec![
            RowMove::Load {
                table: 0,
                row: 7,
                slot: 0
            },
            RowMove::Load {
                table: 0,
                row: 3,
                slot: 1
            },
        ]
    );
    assert_eq!(mapped.ids(), &[0, 1, 0, 3, 0, 2]);
    // An evaluation batch (not training): row 5 evicts row 7 (least recently used, dirty from
    // the training batch: written back first) and is loaded clean.
    let (moves, _) = planner
        .map_batch(&batch_of(&layout, [&[3], &[5]], [&[], &[]]), false)
        .unwrap();
    assert_eq!(
        moves,
        vec![
            RowMove::WriteBack {
                table: 0,
                row: 7,
                slot: 0
            },
            RowMove::Load {
                table: 0,
                row: 5,
                slot: 0
            },
        ]
    );
    // Evicting the clean row 5 writes nothing back; row 3 (still dirty) stays.
    let (moves, _) = planner
        .map_batch(&batch_of(&layout, [&[9], &[3]], [&[1], &[]]), true)
        .unwrap();
    assert_eq!(
        moves,
        vec![RowMove::Load {
            table: 0,
            row: 9,
            slot: 0
        }]
    );
    let stats = planner.stats();
    assert_eq!(
        (stats.hits, stats.loads, stats.evictions, stats.write_backs),
        (2, 4, 2, 1)
    );
    // A flush writes back the dirty cached rows (3 and 9), once.
    let mut flushed = planner.flush();
    flushed.sort_by_key(|m| format!("{m:?}"));
    assert_eq!(
        flushed,
        vec![
            RowMove::WriteBack {
                table: 0,
                row: 3,
                slot: 1
            },
            RowMove::WriteBack {
                table: 0,
                row: 9,
                slot: 0
            },
        ]
    );
    assert!(planner.flush().is_empty());
}

#[test]
fn moves_become_copies_of_whole_rows_and_their_state() {
    let backing = two_tables();
    let planner = RowCachePlanner::new(&backing, &[2, 4]).unwrap();
    let cache = planner.cache_layout().clone();
    let moves = [
        RowMove::WriteBack {
            table: 0,
            row: 7,
            slot: 0,
        },
        RowMove::Load {
            table: 0,
            row: 4,
            slot: 1,
        },
    ];
    let copies = BatchCopies::new(&moves, &backing, &cache);
    // Table 0 starts both buffers; table 0's row 7 is elements 21..24 and stacked row 7.
    assert_eq!(copies.write_backs.elements, vec![[0, 21, 3]]);
    assert_eq!(copies.write_backs.rows, vec![[0, 7, 1]]);
    assert_eq!(copies.loads.elements, vec![[12, 3, 3]]);
    assert_eq!(copies.loads.rows, vec![[4, 1, 1]]);
    // Bytes: weights only (SGD), + one accumulator (Adagrad), + two moments (Adam).
    let l = &copies.loads;
    assert_eq!(l.bytes(&SparseOptimizer::Sgd { lr: 0.1 }), 12);
    assert_eq!(l.bytes(&SparseOptimizer::row_wise_adagrad(0.1)), 16);
    assert_eq!(l.bytes(&SparseOptimizer::adam(0.1)), 36);
    // The resident table 1: backing elements 30..38 / rows 10..14, cache 6..14 / 2..6.
    let whole = BatchCopies::whole_tables(&[1], &backing, &cache, true);
    assert_eq!(whole.elements, vec![[30, 6, 8]]);
    assert_eq!(whole.rows, vec![[10, 2, 4]]);
}

#[test]
fn residency_fits_the_budget_largest_tables_to_host_first() {
    let layout = TableLayout::new(
        [(1000, 4), (50, 4), (5000, 8), (100, 1)]
            .iter()
            .map(|&(rows, dim)| TableSpec {
                rows,
                dim,
                pooling: Pooling::Sum,
            })
            .collect(),
    )
    .unwrap();
    let adagrad = SparseOptimizer::row_wise_adagrad(0.1);
    // Row bytes with Adagrad: 4 * (dim + 1): 20, 20, 36, 8. Whole tables: 20,000 + 1,000 +
    // 180,000 + 800 = 201,800 bytes.
    let all = plan_residency(&layout, &adagrad, 201_800, &HostRows::Auto, 64).unwrap();
    assert!(all.all_on_device());
    assert_eq!(all.slots, vec![1000, 50, 5000, 100]);
    // 100 KB: the largest table (2) goes to host and the rest (21,800 bytes) stays; its cache
    // gets the minimum of 64 rows plus the spare 75,896 bytes' 2,108 rows of 36 bytes.
    let plan = plan_residency(&layout, &adagrad, 100_000, &HostRows::Auto, 64).unwrap();
    assert_eq!(plan.host_tables, vec![2]);
    assert_eq!(plan.slots, vec![1000, 50, 2172, 100]);
    assert!(plan.device_bytes <= 100_000, "{plan:?}");
    assert_eq!(plan.host_bytes, 180_000);
    // Explicit tables; a table no bigger than a batch's rows stays whole (nothing to gain).
    let plan = plan_residency(
        &layout,
        &adagrad,
        200_000,
        &HostRows::Tables(vec![0, 1]),
        64,
    )
    .unwrap();
    assert_eq!(plan.host_tables, vec![0]);
    assert!(plan.slots[0] >= 64 && plan.slots[0] < 1000, "{plan:?}");
    // Too small even with every large table cached: refused, naming the fix.
    let err = plan_residency(&layout, &adagrad, 5_000, &HostRows::Auto, 64)
        .unwrap_err()
        .to_string();
    assert!(err.contains("raise the budget"), "{err}");
    let err = plan_residency(&layout, &adagrad, 1 << 30, &HostRows::Tables(vec![9]), 64)
        .unwrap_err()
        .to_string();
    assert!(err.contains("table 9"), "{err}");
    assert_eq!("auto".parse::<HostRows>().unwrap(), HostRows::Auto);
    assert_eq!(
        "2, 0".parse::<HostRows>().unwrap(),
        HostRows::Tables(vec![2, 0])
    );
    assert!("big".parse::<HostRows>().is_err());
}

#[test]
fn byte_sizes_parse_with_binary_and_decimal_units() {
    assert_eq!(parse_bytes("2GiB").unwrap(), 2 << 30);
    assert_eq!(parse_bytes("512 MiB").unwrap(), 512 << 20);
    assert_eq!(parse_bytes("1.5GB").unwrap(), 1_500_000_000);
    assert_eq!(parse_bytes("4096").unwrap(), 4096);
    assert!(parse_bytes("2 parsecs").unwrap_err().contains("2GiB"));
    assert!(parse_bytes("0").is_err());
}

#[test]
fn lru_gives_up_the_least_recently_used_slot_never_one_of_the_batch() {
    let mut lru = LruSlots::new(3).unwrap();
    let p = lru.plan(&[10, 11, 10]).unwrap();
    assert_eq!(
        (p.loads, p.evictions, p.hits),
        (vec![(10, 0), (11, 1)], vec![], 0)
    );
    let p = lru.plan(&[12]).unwrap();
    assert_eq!((p.loads, p.evictions), (vec![(12, 2)], vec![]));
    // 10 and 11 were used before 12; touching 10 leaves 11 the least recently used.
    let p = lru.plan(&[10]).unwrap();
    assert_eq!(p.hits, 1);
    let p = lru.plan(&[13, 12]).unwrap();
    assert_eq!(
        (p.loads, p.evictions, p.hits),
        (vec![(13, 1)], vec![(11, 1)], 1)
    );
    // A batch of three new rows takes all slots, none of its own rows evicted.
    let p = lru.plan(&[20, 21, 22]).unwrap();
    assert_eq!(p.loads.len(), 3);
    assert_eq!(p.evictions.len(), 3);
    for r in [20, 21, 22] {
        assert!(lru.slot(r).is_some(), "row {r} not cached");
    }
    // More distinct rows than slots: refused, nothing changed.
    let err = lru.plan(&[1, 2, 3, 4]).unwrap_err().to_string();
    assert!(
        err.contains("4 distinct rows") && err.contains("holds 3"),
        "{err}"
    );
    assert_eq!(lru.cached().count(), 3);
    assert!(LruSlots::new(0).is_err());
}

/// A slow, obvious LRU: slots in a vector from least to most recently used.
struct ReferenceLru {
    order: Vec<u32>,
    row_of: Vec<Option<u32>>,
}

impl ReferenceLru {
    fn plan(&mut self, rows: &[u32]) -> SlotPlan {
        let mut distinct = Vec::new();
        for &r in rows {
            if !distinct.contains(&r) {
                distinct.push(r);
            }
        }
        let slot_of = |row_of: &[Option<u32>], r: u32| row_of.iter().position(|&x| x == Some(r));
        let touch = |order: &mut Vec<u32>, s: u32| {
            order.retain(|&x| x != s);
            order.push(s);
        };
        let mut hits = 0;
        let mut missing = Vec::new();
        for &r in &distinct {
            match slot_of(&self.row_of, r) {
                Some(s) => {
                    hits += 1;
                    touch(&mut self.order, s as u32);
                }
                None => missing.push(r),
            }
        }
        let (mut loads, mut evictions) = (Vec::new(), Vec::new());
        for r in missing {
            let s = self.order[0];
            if let Some(old) = self.row_of[s as usize] {
                evictions.push((old, s));
            }
            self.row_of[s as usize] = Some(r);
            touch(&mut self.order, s);
            loads.push((r, s));
        }
        SlotPlan {
            loads,
            evictions,
            hits,
        }
    }
}

#[test]
fn lru_matches_a_reference_on_random_batches() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(17);
    for slots in [1usize, 2, 7, 40] {
        let mut lru = LruSlots::new(slots).unwrap();
        let mut reference = ReferenceLru {
            order: (0..slots as u32).collect(),
            row_of: vec![None; slots],
        };
        for step in 0..300 {
            // Up to `slots` distinct rows of 0..3 slots' worth, repeats included.
            let distinct = rng.random_range(1..=slots);
            let pool: Vec<u32> = (0..distinct)
                .map(|_| rng.random_range(0..3 * slots as u32))
                .collect();
            let rows: Vec<u32> = (0..rng.random_range(1..=2 * slots))
                .map(|_| pool[rng.random_range(0..pool.len())])
                .collect();
            let got = lru.plan(&rows).unwrap();
            let want = reference.plan(&rows);
            assert_eq!(got, want, "{slots} slots, step {step}, rows {rows:?}");
            for &r in &rows {
                assert!(lru.slot(r).is_some(), "row {r} of the batch is not cached");
            }
        }
    }
}

#[test]
fn training_through_a_small_cache_equals_training_the_whole_tables() {
    let layout = odd_layout();
    for optimizer in [
        SparseOptimizer::Sgd { lr: 0.1 },
        SparseOptimizer::row_wise_adagrad(0.1),
        SparseOptimizer::adam(0.01),
    ] {
        let mut full = EmbeddingTables::new(layout.clone(), 3);
        let mut full_state = SparseState::new(optimizer, &layout).unwrap();
        // A third of each table (at least one batch's worth of rows: 24 bags of <= 3 ids).
        let slots: Vec<usize> = layout
            .specs()
            .iter()
            .map(|s| s.rows.min((s.rows / 3).max(72)))
            .collect();
        let mut cached = CachedEmbeddingBag::new(
            full.clone(),
            SparseState::new(optimizer, &layout).unwrap(),
            &slots,
        )
        .unwrap();
        let width = layout.total_dim();
        for step in 0..40u64 {
            let batch = random_batch(&layout, 24, 3, 1.1, 100 + step);
            let dout = random_values(24 * width, 200 + step);
            let mut want = vec![0.0; 24 * width];
            embedding_bag_forward(&full, &batch, &mut want).unwrap();
            embedding_bag_backward_update(&mut full, &batch, &dout, &mut full_state).unwrap();

            let slot_batch = cached.map_batch(&batch, true).unwrap();
            let mut got = vec![f32::NAN; 24 * width];
            cached.forward(&slot_batch, &mut got).unwrap();
            assert!(
                got == want,
                "{optimizer:?} step {step}: forward through the cache differs"
            );
            cached.backward_update(&slot_batch, &dout).unwrap();
        }
        let stats = cached.stats();
        let (tables, state) = cached.flush();
        assert!(
            tables.weights == full.weights,
            "{optimizer:?}: weights differ"
        );
        assert_eq!(state, &full_state, "{optimizer:?}: optimizer state differs");
        eprintln!("{optimizer:?}: {stats:?}");
        assert!(stats.evictions > 0 && stats.write_backs > 0, "{stats:?}");
        assert!(stats.hits > 0, "{stats:?}");
    }
}

#[test]
fn evaluation_batches_write_nothing_back() {
    let layout = odd_layout();
    let tables = EmbeddingTables::new(layout.clone(), 5);
    let state = SparseState::new(SparseOptimizer::row_wise_adagrad(0.1), &layout).unwrap();
    let slots: Vec<usize> = layout.specs().iter().map(|s| s.rows.min(72)).collect();
    let mut cached = CachedEmbeddingBag::new(tables.clone(), state.clone(), &slots).unwrap();
    for step in 0..10 {
        let batch = random_batch(&layout, 24, 3, 0.5, step);
        let slot_batch = cached.map_batch(&batch, false).unwrap();
        let mut out = vec![0.0; 24 * layout.total_dim()];
        cached.forward(&slot_batch, &mut out).unwrap();
    }
    assert!(cached.stats().evictions > 0);
    assert_eq!(cached.stats().write_backs, 0);
    let (flushed, flushed_state) = cached.flush();
    assert!(flushed.weights == tables.weights);
    assert_eq!(flushed_state, &state);
    // A batch with more distinct rows of a table than its slots: refused, naming the fix.
    let big = random_batch(&layout, 400, 3, 0.0, 9);
    let err = cached.map_batch(&big, true).unwrap_err().to_string();
    assert!(err.contains("more slots"), "{err}");
}
