//! tilearn's DeepFM follows a PyTorch DeepFM (same initial weights, same 200 batches) step for
//! step, with row-wise Adagrad and with SparseAdam on the tables and AdamW on the dense part;
//! the fixture and the script that wrote it are in `tests/parity/`.
//!
//! Tolerance: every step's loss within 1e-5 relative of torch's, the first within 1e-6. Both
//! sides compute in f32 with the same formulas, but in different orders (torch's GEMMs and
//! reductions block their sums; the row-wise Adagrad reference is written in torch ops, not in
//! tilearn's fused order), so the weights differ by rounding from the first update on, and
//! AdamW can turn rounding differences of near-zero gradient elements into lr-sized steps.
//! Measured with the committed fixture (torch 2.11, CPU): at most 2e-7 relative over the 200
//! steps for both rules (printed below). 1e-5 leaves 50x room for another BLAS, while a real
//! mismatch (a wrong bias correction, a missing term, a rule applied to the wrong rows) moves
//! the loss by 1e-3 or more within a few steps.

mod parity;

use tilearn_recsys::SparseOptimizer;

#[test]
fn deepfm_follows_the_pytorch_loss_curve() {
    let fixture = parity::load();
    for (name, sparse, torch) in [
        (
            "row-wise adagrad",
            SparseOptimizer::row_wise_adagrad(fixture.adagrad_lr),
            &fixture.loss_adagrad,
        ),
        (
            "sparse adam",
            SparseOptimizer::adam(fixture.adam_lr),
            &fixture.loss_adam,
        ),
    ] {
        let mut model = fixture.model(sparse);
        let ours = fixture.run(&mut model);
        let worst = parity::worst_relative(&ours, torch);
        eprintln!(
            "{name}: torch {:.6} -> {:.6}, tilearn {:.6} -> {:.6}, worst rel diff {worst:e}",
            torch[0],
            torch[fixture.steps - 1],
            ours[0],
            ours[fixture.steps - 1]
        );
        assert!(
            ((ours[0] - torch[0]) / torch[0]).abs() <= 1e-6,
            "{name}: first loss {} vs torch {}",
            ours[0],
            torch[0]
        );
        assert!(
            worst <= 1e-5,
            "{name}: worst relative loss difference {worst:e}"
        );
    }
}
