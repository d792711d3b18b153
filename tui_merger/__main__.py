from tui_merger.cli import entry

entry()
