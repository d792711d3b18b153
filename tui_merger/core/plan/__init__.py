"""From inputs to a plan: every output tensor and its ops, findings before anything is written, estimates."""
