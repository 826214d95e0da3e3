"""agl-stream processors (the layout is in docs/design-notes.md)."""
