"""The OpenAI-compatible HTTP API, the dashboard's JSON, metrics and the web page (static/)."""
