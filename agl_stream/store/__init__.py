"""The event-sourced LightningStore: every change is an event on Kafka, state is folded by the
rollout processor, reads come from ClickHouse behind offset fences (docs/design-notes.md)."""
