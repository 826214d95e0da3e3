"""agl-stream: Agent Lightning as an event-sourced pipeline over Apache Kafka."""

__version__ = "0.1.0"
