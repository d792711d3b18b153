"""What a merge records: merge_manifest.json, the sha256 of inputs and outputs, the model card."""
