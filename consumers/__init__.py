"""agl-stream consumers (the layout is in docs/design-notes.md)."""
