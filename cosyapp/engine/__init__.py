"""The shared serving engine: speech-token LM engines, the batched token2wav worker, the Pipeline."""
