"""The merge itself: tensors merged and written shard by shard, the partial folder, the journal, the atomic rename, detached jobs."""
