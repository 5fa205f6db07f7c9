# Phase `famgold` (sourced by scripts/gpu-call.sh; uses its `run` and $OUT): the model-family
# golden fixtures (tests/golden_families/) regenerated on the GPU machine with its transformers
# and torch, into $OUT/famgold (tar), so that the committed fixtures are the GPU machine's.
run famgold python3 tests/golden_families/make_family_golden.py --out "$OUT/famgold"
(cd "$OUT" && tar -cf famgold.tar famgold && rm -rf famgold)
