"""tui-merger: turn a finished training run into a model people can ship."""

__version__ = "0.1.0"
