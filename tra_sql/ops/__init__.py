"""Node kinds defined outside the core IR, each with its rules (see docs/architecture.md)."""
