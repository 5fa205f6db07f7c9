//! Criteo-shaped synthetic data from a known ground-truth model, so a training run can be
//! judged against the best achievable AUC. Everything is a function of the seed and the sample
//! index: any range of samples can be generated on its own, identically.
//!
//! Each sample: 13 integer features `x_i = floor(exp(N(1, 1.2)))` (empty with probability 0.1),
//! 26 categorical fields whose values are zipf-skewed (exponent 1.05) over a per-field vocabulary
//! and spread into 32-bit "hex" values (empty with probability 0.05), and a label drawn from
//!
//! `p = sigmoid(b + sum_i beta_i ln(1 + x_i) + sum_f w_f(v_f) + sum_{(f,g) in P} <u_f(v_f), u_g(v_g)>)`
//!
//! where `w` and the dim-4 latent vectors `u` are hashed from (seed, field, value), and `P` pairs
//! field 2j with 2j + 1 for the first eight fields: first-order effects and pairwise interactions,
//! what DeepFM and Wide & Deep model.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::batch::{CtrBatch, MISSING, transform_dense};
use crate::hash::mix64;
use crate::zipf::Zipf;

/// The generator's parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SyntheticCriteo {
    pub seed: u64,
    pub num_dense: usize,
    /// Distinct values of each categorical field.
    pub vocab: Vec<usize>,
    /// Scale of the first-order weights and of the interaction vectors.
    pub weight_scale: f64,
    pub interaction_scale: f64,
    pub bias: f64,
}

const LATENT: usize = 4;
const INTERACTING_FIELDS: usize = 8;

impl SyntheticCriteo {
    /// Criteo's shape (13 dense, 26 fields) with vocabularies from 10 to `max_vocab` values.
    pub fn criteo_shaped(seed: u64, max_vocab: usize) -> Self {
        let vocab = (0..26)
            .map(|f| (10usize << (f % 8)).min(max_vocab.max(10)))
            .collect();
        SyntheticCriteo {
            seed,
            num_dense: 13,
            vocab,
            weight_scale: 1.2,
            interaction_scale: 0.9,
            bias: -1.6,
        }
    }

    pub fn num_fields(&self) -> usize {
        self.vocab.len()
    }

    /// A value in [-1, 1) hashed from the generator's seed and `key`.
    fn unit(&self, key: u64) -> f64 {
        let h = mix64(self.seed ^ mix64(key));
        (h >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }

    fn key(field: usize, value: u64, slot: usize) -> u64 {
        value ^ ((field as u64) << 40) ^ ((slot as u64) << 52)
    }

    fn dense_weight(&self, i: usize) -> f64 {
        0.25 * self.unit(0xd15e_0000 + i as u64)
    }

    /// The ground-truth logit of one sample (dense already transformed, raw categorical values).
    pub fn true_logit(&self, dense: &[f32], cats: &[u64]) -> f64 {
        let mut z = self.bias;
        for (i, &x) in dense.iter().enumerate() {
            z += self.dense_weight(i) * x as f64;
        }
        for (f, &v) in cats.iter().enumerate() {
            if v != MISSING {
                z += self.weight_scale * self.unit(Self::key(f, v, 0));
            }
        }
        for pair in 0..INTERACTING_FIELDS.min(cats.len()) / 2 {
            let (f, g) = (2 * pair, 2 * pair + 1);
            if cats[f] == MISSING || cats[g] == MISSING {
                continue;
            }
            let dot: f64 = (1..=LATENT)
                .map(|j| self.unit(Self::key(f, cats[f], j)) * self.unit(Self::key(g, cats[g], j)))
                .sum();
            z += self.interaction_scale * dot;
        }
        z
    }

    /// Samples `start .. start + n`, and their ground-truth logits.
    pub fn generate(&self, start: u64, n: usize) -> (CtrBatch, Vec<f64>) {
        let fields = self.num_fields();
        let mut batch = CtrBatch::new(self.num_dense, fields);
        let mut logits = Vec::with_capacity(n);
        let zipfs: Vec<Zipf> = self.vocab.iter().map(|&v| Zipf::new(v, 1.05)).collect();
        for index in start..start + n as u64 {
            let mut rng = ChaCha8Rng::seed_from_u64(mix64(self.seed ^ mix64(index)));
            let dense_start = batch.dense.len();
            for _ in 0..self.num_dense {
                let x = if rng.random_bool(0.1) {
                    None
                } else {
                    let normal: f64 = (0..4).map(|_| rng.random::<f64>()).sum::<f64>() - 2.0;
                    Some((1.0 + 1.2 * normal * 1.73).exp().floor() as i64)
                };
                batch.dense.push(transform_dense(x));
            }
            let cat_start = batch.cats.len();
            for (f, zipf) in zipfs.iter().enumerate() {
                let v = if rng.random_bool(0.05) {
                    MISSING
                } else {
                    // Spread the rank into a 32-bit value, as Criteo's hashed hex strings look.
                    mix64(zipf.sample(&mut rng) ^ ((f as u64) << 32)) & 0xffff_ffff
                };
                batch.cats.push(v);
            }
            let z = self.true_logit(&batch.dense[dense_start..], &batch.cats[cat_start..]);
            let p = 1.0 / (1.0 + (-z).exp());
            batch
                .labels
                .push(if rng.random_bool(p) { 1.0 } else { 0.0 });
            logits.push(z);
        }
        (batch, logits)
    }
}

impl SyntheticCriteo {
    /// [`generate`](Self::generate) split over the cores (each sample depends only on the seed
    /// and its index, so the result is identical): for benchmarks of millions of samples.
    pub fn generate_parallel(&self, start: u64, n: usize) -> (CtrBatch, Vec<f64>) {
        const CHUNK: usize = 8192;
        let parts: Vec<(CtrBatch, Vec<f64>)> = (0..n.div_ceil(CHUNK))
            .into_par_iter()
            .map(|c| {
                let first = c * CHUNK;
                self.generate(start + first as u64, CHUNK.min(n - first))
            })
            .collect();
        let mut batch = CtrBatch::new(self.num_dense, self.num_fields());
        let mut logits = Vec::with_capacity(n);
        for (part, part_logits) in parts {
            batch.extend(&part);
            logits.extend(part_logits);
        }
        (batch, logits)
    }
}

/// Writes samples as Criteo TSV lines (for `tilearn ctr prepare` tests and demos): the dense
/// features are written back as integers `round(exp(x) - 1)`, the inverse of the transform.
pub fn write_tsv_lines(batch: &CtrBatch, out: &mut impl std::io::Write) -> std::io::Result<()> {
    for b in 0..batch.len() {
        let mut line = format!("{}", batch.labels[b] as u8);
        for &x in &batch.dense[b * batch.num_dense..(b + 1) * batch.num_dense] {
            if x == 0.0 {
                line.push('\t');
            } else {
                line.push_str(&format!("\t{}", ((x as f64).exp() - 1.0).round() as i64));
            }
        }
        for &v in &batch.cats[b * batch.num_fields..(b + 1) * batch.num_fields] {
            if v == MISSING {
                line.push('\t');
            } else {
                line.push_str(&format!("\t{v:08x}"));
            }
        }
        line.push('\n');
        out.write_all(line.as_bytes())?;
    }
    Ok(())
}
