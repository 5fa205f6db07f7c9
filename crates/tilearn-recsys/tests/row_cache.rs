//! The row cache of tables larger than the device (`cache`): the LRU slot policy, and training
//! through a cache smaller than the tables giving the weights and optimizer state of training
//! on the whole tables, bit for bit (each row's update sees the same contributions in the same
//! order; only the rows' places differ), with rows evicted and written back along the way.

mod common;

use common::{odd_layout, random_batch, random_values};
use tilearn_recsys::cache::{CachedEmbeddingBag, LruSlots};
use tilearn_recsys::{
    EmbeddingTables, SparseOptimizer, SparseState, embedding_bag_backward_update,
    embedding_bag_forward,
};

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
