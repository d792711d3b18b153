"""One module per checkpoint kind behind one protocol (formats/base.py) and one registry (formats/registry.py)."""
