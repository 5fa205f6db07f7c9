//! Criteo TSV parsing (empty fields, malformed lines counted and never a crash), the synthetic
//! generator (deterministic by sample index, a learnable ground truth), TSV and shard round
//! trips with corruption detected, and the loader's epochs.

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_recsys::auc;
use tilearn_recsys::data::{
    CRITEO_DENSE, CRITEO_FIELDS, CtrBatch, MISSING, Prefetcher, SyntheticCriteo, read_shards,
    read_tsv, write_shards, write_tsv_lines,
};

fn line(label: &str, ints: &[&str], cats: &[&str]) -> String {
    let mut fields = vec![label.to_string()];
    fields.extend(ints.iter().map(|s| s.to_string()));
    fields.extend(cats.iter().map(|s| s.to_string()));
    fields.join("\t")
}

#[test]
fn criteo_lines_parse_with_empty_fields_and_bad_lines_are_counted() {
    let ints: Vec<&str> = (0..13).map(|i| if i % 3 == 0 { "" } else { "5" }).collect();
    let cats: Vec<&str> = (0..26)
        .map(|i| if i == 4 { "" } else { "68fd1e64" })
        .collect();
    let good = line("1", &ints, &cats);
    let mut bad_int = ints.clone();
    bad_int[2] = "x1";
    let mut bad_hex = cats.clone();
    bad_hex[0] = "zz";
    let mut long_hex = cats.clone();
    long_hex[1] = "0123456789abcdef0";
    let text = [
        good.clone(),
        line("2", &ints, &cats),
        line("0", &bad_int, &cats),
        line("0", &ints, &bad_hex),
        line("0", &ints, &long_hex),
        "1\t2\t3".to_string(),
        String::new(),
        format!("{good}\r"),
        line("0", &["-1"; 13], &[""; 26]),
    ]
    .join("\n");
    let (batch, report) = read_tsv(text.as_bytes(), "t.tsv".as_ref()).unwrap();
    assert_eq!((report.lines, report.samples, report.malformed), (9, 3, 6));
    let lines: Vec<usize> = report.first_errors.iter().map(|e| e.0).collect();
    assert_eq!(lines, [2, 3, 4, 5, 6, 7]);
    assert!(report.first_errors[1].1.contains("I3"));
    assert!(report.first_errors[4].1.contains("expected 40"));
    assert_eq!(batch.labels, [1.0, 1.0, 0.0]);
    assert_eq!(batch.dense[0], 0.0);
    assert_eq!(batch.dense[1], (6.0f64).ln() as f32);
    assert_eq!(batch.cats[4], MISSING);
    assert_eq!(batch.cats[0], 0x68fd1e64);
    // Negative integers and all-empty categorical fields are valid.
    assert!(batch.dense[2 * 13..].iter().all(|&x| x == 0.0));
    assert!(batch.cats[2 * 26..].iter().all(|&v| v == MISSING));
}

#[test]
fn random_bytes_never_crash_the_parser() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let alphabet = b"01\t\t\t\t-9af\r\n \xff";
    for _ in 0..200 {
        let bytes: Vec<u8> = (0..rng.random_range(0..300))
            .map(|_| alphabet[rng.random_range(0..alphabet.len())])
            .collect();
        let text = String::from_utf8_lossy(&bytes).into_owned();
        let (batch, report) = read_tsv(text.as_bytes(), "fuzz".as_ref()).unwrap();
        assert_eq!(report.samples + report.malformed, report.lines);
        assert_eq!(batch.len(), report.samples);
    }
}

#[test]
fn synthetic_data_is_a_function_of_the_index_with_a_learnable_truth() {
    let generator = SyntheticCriteo::criteo_shaped(3, 500);
    let (all, logits) = generator.generate(0, 4000);
    let (part, part_logits) = generator.generate(1000, 50);
    assert_eq!(part, all.slice(1000..1050));
    assert_eq!(part_logits, logits[1000..1050]);
    assert_eq!(
        (all.num_dense, all.num_fields),
        (CRITEO_DENSE, CRITEO_FIELDS)
    );
    let ctr = all.labels.iter().sum::<f32>() / all.len() as f32;
    assert!((0.1..0.5).contains(&ctr), "click rate {ctr}");
    let scores: Vec<f32> = logits.iter().map(|&z| z as f32).collect();
    let truth = auc(&scores, &all.labels).unwrap();
    assert!(truth > 0.72, "ground-truth AUC {truth}");
    // A different seed is a different world.
    assert_ne!(
        SyntheticCriteo::criteo_shaped(4, 500).generate(0, 10).0,
        all.slice(0..10)
    );
}

#[test]
fn tsv_and_shards_round_trip_and_corruption_is_detected() {
    let (batch, _) = SyntheticCriteo::criteo_shaped(1, 300).generate(0, 257);
    let mut tsv = Vec::new();
    write_tsv_lines(&batch, &mut tsv).unwrap();
    let (parsed, report) = read_tsv(tsv.as_slice(), "synthetic.tsv".as_ref()).unwrap();
    assert_eq!(report.malformed, 0);
    assert_eq!(
        (parsed.labels.clone(), parsed.cats.clone()),
        (batch.labels.clone(), batch.cats.clone())
    );
    assert!(
        parsed
            .dense
            .iter()
            .zip(&batch.dense)
            .all(|(a, b)| (a - b).abs() < 1e-6)
    );

    let dir = tempfile::tempdir().unwrap();
    let meta = write_shards(dir.path(), &batch, 100, serde_json::json!({"test": true})).unwrap();
    assert_eq!(meta.shards.len(), 3);
    let (read_meta, read) = read_shards(dir.path()).unwrap();
    assert_eq!((read_meta, read), (meta, batch));

    let shard = dir.path().join("shard-00001.bin");
    let mut bytes = std::fs::read(&shard).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&shard, &bytes).unwrap();
    let err = read_shards(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("shard-00001.bin") && err.contains("checksum"),
        "{err}"
    );
    std::fs::write(&shard, &bytes[..bytes.len() - 9]).unwrap();
    assert!(
        read_shards(dir.path())
            .unwrap_err()
            .to_string()
            .contains("truncated")
    );
}

#[test]
fn the_loader_covers_every_sample_once_per_epoch() {
    let mut data = CtrBatch::new(1, 1);
    for i in 0..10 {
        data.labels.push(0.0);
        data.dense.push(i as f32);
        data.cats.push(i);
    }
    let batches: Vec<CtrBatch> = Prefetcher::new(Arc::new(data), 4, 6, 7).collect();
    assert_eq!(
        batches.iter().map(|b| b.len()).collect::<Vec<_>>(),
        [4, 4, 2, 4, 4, 2]
    );
    for epoch in [&batches[..3], &batches[3..]] {
        let mut seen: Vec<u64> = epoch.iter().flat_map(|b| b.cats.clone()).collect();
        seen.sort();
        assert_eq!(seen, (0..10).collect::<Vec<_>>());
    }
    assert_ne!(
        batches[0].cats, batches[3].cats,
        "each epoch has its own order"
    );
    // Dropping a loader early stops its worker.
    drop(Prefetcher::new(Arc::new(CtrBatch::new(1, 1)), 4, 100, 0));
}
