//! Exact ROC AUC: the Mann-Whitney statistic over all (positive, negative) pairs, ties counted
//! one half, computed from a sort in O(n log n) (no binning, unlike streaming approximations).

/// AUC of `scores` against `labels` (> 0.5 = positive). `None` when one class is absent (AUC is
/// undefined).
pub fn auc(scores: &[f32], labels: &[f32]) -> Option<f64> {
    assert_eq!(scores.len(), labels.len(), "auc: one label per score");
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]));
    let positives = labels.iter().filter(|&&y| y > 0.5).count();
    let negatives = labels.len() - positives;
    if positives == 0 || negatives == 0 {
        return None;
    }
    // Sum of the positives' ranks (1-based; a run of tied scores shares its mean rank).
    let mut rank_sum = 0.0f64;
    let mut i = 0;
    while i < order.len() {
        let mut j = i;
        while j + 1 < order.len() && scores[order[j + 1]] == scores[order[i]] {
            j += 1;
        }
        let mean_rank = (i + j) as f64 / 2.0 + 1.0;
        rank_sum += mean_rank * order[i..=j].iter().filter(|&&s| labels[s] > 0.5).count() as f64;
        i = j + 1;
    }
    let p = positives as f64;
    Some((rank_sum - p * (p + 1.0) / 2.0) / (p * negatives as f64))
}
