"""The wizard's six steps, one module each (Find, Review, Merge, Verify, Try it, Finish), and what they
share (``common``: the worker messages and the one place a worker's outcome is sorted)."""
