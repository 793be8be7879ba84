"""Images and other media for both generation protocols: VllmEngine's media
references, tensors and shared memory, vllm.Inference's media items, and the
decoded images' budget."""
