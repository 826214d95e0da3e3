"""agl-stream consumers (see DESIGN.md's layout table)."""
