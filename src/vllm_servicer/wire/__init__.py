"""Each protocol's messages and vLLM's objects, both ways (VllmEngine,
vllm.Inference, Pooling, Render, and what they share): no grpc here."""
