"""agl-stream producers (the layout is in docs/design-notes.md)."""
