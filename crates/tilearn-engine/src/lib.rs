//! tilearn-engine: Llama-family models, Hugging Face checkpoint I/O, the data pipeline and the
//! Trainer.
