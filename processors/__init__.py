"""agl-stream processors (see DESIGN.md's layout table)."""
