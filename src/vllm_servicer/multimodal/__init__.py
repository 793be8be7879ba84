"""Images and other media for Generate: tensors, shared memory, media references."""
