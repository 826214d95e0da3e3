"""agl-stream producers (see DESIGN.md's layout table)."""
