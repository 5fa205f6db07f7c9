//! Packed rows and the examples they hold: the fixture of the packing tests on the CPU and GPU
//! engines. A packed row must give the loss and gradients of its examples run one by one.

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::sft::IGNORE;

/// One example: its token ids and Hugging Face unshifted labels.
pub struct Example {
    pub ids: Vec<u32>,
    pub labels: Vec<i32>,
}

/// Examples of the given lengths: random ids, labels = ids with the first third of each
/// example (its "prompt") ignored.
pub fn random_examples(rng: &mut ChaCha8Rng, vocab: usize, lens: &[usize]) -> Vec<Example> {
    lens.iter()
        .map(|&len| {
            let ids: Vec<u32> = (0..len)
                .map(|_| rng.random_range(0..vocab as u32))
                .collect();
            let labels = ids
                .iter()
                .enumerate()
                .map(|(t, &id)| if t < len / 3 { IGNORE } else { id as i32 })
                .collect();
            Example { ids, labels }
        })
        .collect()
}

/// Rows of `seq` tokens holding `rows` (lists of example indices, in order), the way
/// `prepare-data --packing` lays them out: each example's first label ignored (the previous
/// example's last token must not predict it), positions restarting at 0 per example, and the
/// tail padded with `pad` (its own run of positions, labels ignored). Returns ids, labels and
/// positions, `[rows.len(), seq]`.
pub fn pack(
    examples: &[Example],
    rows: &[&[usize]],
    seq: usize,
    pad: u32,
) -> (Vec<u32>, Vec<i32>, Vec<i32>) {
    let (mut ids, mut labels, mut pos) = (Vec::new(), Vec::new(), Vec::new());
    for row in rows {
        let start = ids.len();
        for &e in row.iter() {
            let ex = &examples[e];
            ids.extend_from_slice(&ex.ids);
            labels.push(IGNORE);
            labels.extend_from_slice(&ex.labels[1..]);
            pos.extend(0..ex.ids.len() as i32);
        }
        let used = ids.len() - start;
        assert!(used <= seq, "the examples of a row exceed seq");
        ids.extend(std::iter::repeat_n(pad, seq - used));
        labels.extend(std::iter::repeat_n(IGNORE, seq - used));
        pos.extend(0..(seq - used) as i32);
    }
    (ids, labels, pos)
}
