"""Readers and writers shared by every checkpoint kind: safetensors, memory maps, the restricted torch unpickler, torch.distributed.checkpoint, the files a model carries."""
