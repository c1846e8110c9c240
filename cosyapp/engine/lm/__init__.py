"""The speech-token LM engines: interface (base), PyTorch (torch_engine), vLLM (vllm_engine, vllm_model)."""
