"""The Textual terminal app: a wizard that merges a training run into a model."""
