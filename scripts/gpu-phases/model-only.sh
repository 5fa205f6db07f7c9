# Phase `model-only`: the engine's model test alone (the `model` phase also runs precision and
# streaming, which a partial bundle may lack).
run gpu_model "$B/tests/gpu_model-test" --include-ignored --test-threads=1 --nocapture
